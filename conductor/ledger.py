"""What the conductor itself has sent to each instance, turned into the core's InstanceState.

Load reports from workers lag by their publish interval; the conductor knows at once what it
routed. So the snapshot the scheduler sees is built from this ledger: prefill work queued on
each prefill instance (predicted seconds), sequences decoding on each decode instance, and
sequences on their way to it (prefill not finished yet). Pure, with an explicit clock.

An instance works off its prefill queue at one second per second: the queued seconds a new
request waits behind are the predicted seconds of the jobs routed there, less the time the
instance has spent on them since (`backlog_s`, drained by `_drain(now)`). Counting a running
job's whole prediction until its first token instead overstates the wait by up to one prefill,
which on a CPU is seconds and turned into spurious TTFT refusals near the SLO. A job that ends
early takes its unspent seconds with it (the backlog never exceeds the jobs still queued); one
that runs long leaves the backlog at 0 until it ends, and calibration corrects the scale.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from conductor.core.estimators import Estimators
from conductor.core.types import DecodeSeq, InstanceState, Role


@dataclass
class Ledger:
    prefill_jobs: dict[str, float] = field(default_factory=dict)  # request -> predicted prefill s
    incoming: dict[str, DecodeSeq] = field(default_factory=dict)  # assigned, prefill not done
    running: dict[str, DecodeSeq] = field(default_factory=dict)  # decoding here now
    backlog_s: float = 0.0  # predicted prefill seconds still to do here, as of `as_of`
    as_of: float = 0.0

    def _drain(self, now: float) -> None:
        if self.prefill_jobs and now > self.as_of:
            self.backlog_s = max(0.0, self.backlog_s - (now - self.as_of))
        self.as_of = max(self.as_of, now)

    def _drop_job(self, request_id: str) -> None:
        if self.prefill_jobs.pop(request_id, None) is not None:
            self.backlog_s = min(self.backlog_s, sum(self.prefill_jobs.values()))

    def assign(self, request_id: str, prefill: "Ledger", predicted_prefill_s: float, arrival_s: float,
               kv_tokens: int, tbt_slo_s: float | None = None, max_tokens: int | None = None) -> None:
        """Record a decision: prefill work on `prefill` (may be self), a sequence coming here.
        tbt_slo_s: the request's own TBT SLO, which later requests joining this batch must keep.
        max_tokens: the most it will generate (the forecast's cap on how long it stays)."""
        prefill._drain(arrival_s)
        prefill.prefill_jobs[request_id] = predicted_prefill_s
        prefill.backlog_s += predicted_prefill_s
        self.incoming[request_id] = DecodeSeq(arrival_s + predicted_prefill_s, kv_tokens, tbt_slo_s=tbt_slo_s,
                                              max_tokens=max_tokens)

    def prefill_done(self, request_id: str, prefill: "Ledger", now: float) -> None:
        prefill._drain(now)
        prefill._drop_job(request_id)
        seq = self.incoming.pop(request_id, None)
        if seq is not None:
            self.running[request_id] = DecodeSeq(now, seq.kv_tokens, tbt_slo_s=seq.tbt_slo_s,
                                                 max_tokens=seq.max_tokens)

    def finished(self, request_id: str, prefill: "Ledger") -> None:
        prefill._drop_job(request_id)
        self.incoming.pop(request_id, None)
        self.running.pop(request_id, None)

    def running_load(self) -> tuple[int, int]:
        """(sequences, KV tokens) decoding here now, as the scheduler prices a decode step."""
        return len(self.running), sum(s.kv_tokens for s in self.running.values())

    def state(self, instance_id: str, role: Role, kv_capacity_tokens: int, bandwidth_Bps: float,
              scales: tuple[float, float] = (1.0, 1.0), now: float | None = None) -> InstanceState:
        """scales: the instance's calibrated (prefill, decode-step) speed (Calibration.scales).
        now: drain the prefill backlog to this time first (None: as of the last event)."""
        if now is not None:
            self._drain(now)
        return InstanceState(
            instance_id=instance_id, role=role, queued_prefill_s=self.backlog_s,
            running=tuple(self.running.values()), incoming=tuple(self.incoming.values()),
            kv_capacity_tokens=kv_capacity_tokens or (1 << 62), bandwidth_Bps=bandwidth_Bps,
            prefill_scale=scales[0], decode_scale=scales[1],
        )


def predicted_prefill_s(estimators: Estimators, prompt_tokens: int, cached_tokens: int,
                        prefill_scale: float = 1.0) -> float:
    """What the prefill instance's queue grows by: its calibrated prediction (prefill_scale)."""
    return estimators.prefill_s(prompt_tokens, min(cached_tokens, prompt_tokens), prefill_scale)
