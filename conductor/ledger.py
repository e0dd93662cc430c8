"""What the conductor itself has sent to each instance, turned into the core's InstanceState.

Load reports from workers lag by their publish interval; the conductor knows at once what it
routed. So the snapshot the scheduler sees is built from this ledger: prefill work queued on
each prefill instance (predicted seconds), sequences decoding on each decode instance, and
sequences on their way to it (prefill not finished yet). Pure, with an explicit clock.

An instance works off its prefill queue in order, one job at a time: the queued seconds a new
request waits behind are the predicted seconds of the jobs routed there, less the time spent on
the one at the head since it got there (`head_spent_s`, advanced by `_advance(now)`). Counting a
running job's whole prediction until its first token instead overstates the wait by up to one
prefill, which on a CPU is seconds and turned into spurious TTFT refusals near the SLO. A job
that ends early takes its unspent seconds with it. A job that runs past its prediction counts 0
until it ends, and the jobs behind it count whole: the time it overran was not spent on them.
Draining the whole backlog at one second per second instead let each overrun eat into the jobs
queued behind, so under a standing queue the wait was priced ever shorter than it was
(benchmarks/RESULTS.md, "Sequences on their way"). vLLM may
start the next prompt in the head's last step (chunked prefill); that part, at most one chunk,
is counted as still to do: a small overstatement where the other way erred without bound.

A worker measures a request's decode step as the mean over its whole decode, first token to
last (mooncake/engine/engine.py measured_times), so its calibration sample is priced at the load
it decoded under: the time-weighted mean of the running set's size and KV tokens from when it
started decoding here to when it ended (`decode_load`). The ledger integrates both over time, so
the mean costs two subtractions. Priced at the load when it ended (as it was), a request that
decoded beside 30 others and ended last, alone, was fitted as a batch of 1: its steps, slowed by
the 30, read as a slow host (and one that decoded alone and ended in a burst, as a fast one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conductor.core.estimators import Estimators
from conductor.core.types import DecodeSeq, InstanceState, Role


@dataclass
class Ledger:
    prefill_jobs: dict[str, float] = field(default_factory=dict)  # request -> predicted prefill s, in order
    incoming: dict[str, DecodeSeq] = field(default_factory=dict)  # assigned, prefill not done
    running: dict[str, DecodeSeq] = field(default_factory=dict)  # decoding here now
    head_spent_s: float = 0.0  # seconds spent on the first of prefill_jobs, as of `as_of`
    as_of: float = 0.0
    # The running set's load integrated over time up to `load_as_of` (sequence-seconds and
    # KV-token-seconds), and for each running request the time it started decoding here and the
    # two integrals then: its mean load is their difference over its span (decode_load).
    sequence_s: float = 0.0
    kv_token_s: float = 0.0
    load_as_of: float | None = None
    decode_marks: dict[str, tuple[float, float, float]] = field(default_factory=dict)

    def _advance(self, now: float) -> None:
        if self.prefill_jobs and now > self.as_of:
            self.head_spent_s += now - self.as_of
        self.as_of = max(self.as_of, now)

    def _integrate(self, now: float | None) -> None:
        """Add the running set's load since `load_as_of` to the integrals (call before it changes)."""
        if now is None:
            return
        if self.load_as_of is not None and now > self.load_as_of:
            batch, kv = self.running_load()
            self.sequence_s += batch * (now - self.load_as_of)
            self.kv_token_s += kv * (now - self.load_as_of)
        self.load_as_of = now if self.load_as_of is None else max(self.load_as_of, now)
        if not self.running:  # no request is measuring from a mark: restart at 0, keeping the sums small
            self.sequence_s = self.kv_token_s = 0.0

    def _start_decoding(self, request_id: str, seq: DecodeSeq, now: float) -> None:
        self._integrate(now)
        self.running[request_id] = seq
        self.decode_marks[request_id] = (self.load_as_of, self.sequence_s, self.kv_token_s)

    def _stop_decoding(self, request_id: str, now: float | None) -> DecodeSeq | None:
        self._integrate(now)
        self.decode_marks.pop(request_id, None)
        return self.running.pop(request_id, None)

    @property
    def backlog_s(self) -> float:
        """Predicted prefill seconds still to do here, as of `as_of`."""
        if not self.prefill_jobs:
            return 0.0
        head, *rest = self.prefill_jobs.values()
        return max(head - self.head_spent_s, 0.0) + sum(rest)

    def _drop_job(self, request_id: str) -> None:
        if request_id in self.prefill_jobs:
            if request_id == next(iter(self.prefill_jobs)):
                self.head_spent_s = 0.0  # the next job reaches the head now
            del self.prefill_jobs[request_id]

    def assign(self, request_id: str, prefill: "Ledger", predicted_prefill_s: float, arrival_s: float,
               kv_tokens: int, tbt_slo_s: float | None = None, max_tokens: int | None = None,
               sequence: bool = True) -> None:
        """Record a decision: prefill work on `prefill` (may be self), a sequence coming here.
        tbt_slo_s: the request's own TBT SLO, which later requests joining this batch must keep.
        max_tokens: the most it will generate (the forecast's cap on how long it stays).
        sequence: False for an answer that ends at its prefill on another instance, which never
        joins this batch (the core's Request.ends_at_prefill): only the prefill job is queued."""
        ahead = prefill._queue_job(request_id, predicted_prefill_s, arrival_s)
        if sequence:
            self.incoming[request_id] = DecodeSeq(arrival_s + ahead + predicted_prefill_s, kv_tokens,
                                                  tbt_slo_s=tbt_slo_s, max_tokens=max_tokens)

    def _queue_job(self, request_id: str, predicted_prefill_s: float, now: float) -> float:
        """Queue a prefill job here at `now`; returns the predicted seconds queued ahead of it."""
        self._advance(now)
        if not self.prefill_jobs:
            self.head_spent_s = 0.0  # it starts now, on an idle instance
        ahead = self.backlog_s  # in order: its prefill ends after the queue ahead of it
        self.prefill_jobs[request_id] = predicted_prefill_s
        return ahead

    def prefill_ended(self, request_id: str, now: float) -> None:
        """This instance is done with the request's prompt, though its first token is still to
        come from another (a grammar, penalties or a seed: the decode worker samples it)."""
        self._advance(now)
        self._drop_job(request_id)

    def prefill_done(self, request_id: str, prefill: "Ledger", now: float) -> None:
        prefill._advance(now)
        prefill._drop_job(request_id)
        seq = self.incoming.pop(request_id, None)
        if seq is not None:
            self._start_decoding(request_id, DecodeSeq(now, seq.kv_tokens, tbt_slo_s=seq.tbt_slo_s,
                                                       max_tokens=seq.max_tokens), now)

    def finished(self, request_id: str, prefill: "Ledger", now: float | None = None) -> None:
        """The request left (ended, failed or gone) at `now` (None: as of the last event)."""
        if now is not None:
            prefill._advance(now)
        prefill._drop_job(request_id)
        self.incoming.pop(request_id, None)
        self._stop_decoding(request_id, now)

    def move(self, request_id: str, to: "Ledger", now: float, prefill_too: bool = False) -> None:
        """The request's sequence comes to (or decodes on) `to` instead of here: its worker failed
        before its first token and another took it over. prefill_too: this instance was to
        compute its prompt too (colocated); the job, with its prediction, joins `to`'s queue.
        A running sequence's load is measured on `to` from now: `to`'s worker decodes it afresh,
        and its decode step is that worker's alone."""
        seq = self.incoming.pop(request_id, None)
        if seq is not None:
            to.incoming[request_id] = seq
        seq = self._stop_decoding(request_id, now)
        if seq is not None:
            to._start_decoding(request_id, seq, now)
        if prefill_too and request_id in self.prefill_jobs:
            seconds = self.prefill_jobs[request_id]
            self._advance(now)
            self._drop_job(request_id)
            to._queue_job(request_id, seconds, now)

    def running_load(self) -> tuple[int, int]:
        """(sequences, KV tokens) decoding here now, as the scheduler prices a decode step."""
        return len(self.running), sum(s.kv_tokens for s in self.running.values())

    def decode_load(self, request_id: str, now: float) -> tuple[float, float] | None:
        """(sequences, KV tokens) decoding here, time-weighted over `request_id`'s decode here so
        far (itself included); None if it is not decoding here. The step model is linear in
        both, so the mean step it predicts is the step at this mean load. (The worker's mean is
        per step, which weights a loaded stretch by its steps, not its seconds: slightly less. The
        gap is second order in how much the step time varied over the decode.)"""
        mark = self.decode_marks.get(request_id)
        if mark is None:
            return None
        self._integrate(now)
        since, sequence_s, kv_token_s = mark
        span = self.load_as_of - since
        if span <= 0:
            return self.running_load()
        return (self.sequence_s - sequence_s) / span, (self.kv_token_s - kv_token_s) / span

    def state(self, instance_id: str, role: Role, kv_capacity_tokens: int, bandwidth_Bps: float,
              scales: tuple[float, float] = (1.0, 1.0), now: float | None = None,
              chunk_tokens: int = 0, serves_fetches: bool = True) -> InstanceState:
        """scales: the instance's calibrated (prefill, decode-step) speed (Calibration.scales).
        now: drain the prefill backlog to this time first (None: as of the last event).
        chunk_tokens: its engine's tokens per step (0: the scheduler config's).
        serves_fetches: its KVCache pool serves other workers' fetches."""
        if now is not None:
            self._advance(now)
        return InstanceState(
            instance_id=instance_id, role=role, queued_prefill_s=self.backlog_s,
            running=tuple(self.running.values()), incoming=tuple(self.incoming.values()),
            kv_capacity_tokens=kv_capacity_tokens or (1 << 62), bandwidth_Bps=bandwidth_Bps,
            prefill_scale=scales[0], decode_scale=scales[1], chunk_tokens=chunk_tokens,
            serves_fetches=serves_fetches,
        )


def predicted_prefill_s(estimators: Estimators, prompt_tokens: int, cached_tokens: int,
                        prefill_scale: float = 1.0) -> float:
    """What the prefill instance's queue grows by: its calibrated prediction (prefill_scale)."""
    return estimators.prefill_s(prompt_tokens, min(cached_tokens, prompt_tokens), prefill_scale)
