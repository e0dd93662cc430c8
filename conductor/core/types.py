"""Plain, frozen data that goes into and comes out of the scheduler core.

The shell (live conductor or simulator) builds a ``ClusterState`` snapshot from its load
reports, hands it to ``Scheduler.schedule`` with the current time, and acts on the returned
``Decision`` or ``Rejection``. Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mooncake.defaults import WorkerRole

if TYPE_CHECKING:
    from conductor.core.index import PendingPrefixes, PrefixIndex
    from mooncake.hashing import BlockHash


class Role(enum.StrEnum):
    """The scheduler's pool an instance is in. Values are mooncake.defaults.WorkerRole's (the
    one source of role names); a WorkerRole.BOTH worker is scheduled in the DECODE pool, from
    which it can also prefill colocated."""

    PREFILL = WorkerRole.PREFILL.value
    DECODE = WorkerRole.DECODE.value


class RejectReason(enum.StrEnum):
    """Why a request was refused; the string is what the HTTP 429 body carries."""

    TTFT_SLO = "ttft_slo"  # no prefill choice meets the TTFT SLO
    TBT_SLO = "tbt_slo"  # no decode instance keeps its TBT within the SLO with this request
    NO_CAPACITY = "no_capacity"  # no decode instance has KV room for this request
    NO_INSTANCE = "no_instance"  # the pool needed for this request is empty


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the scheduler sees it.

    block_hashes are the prefix keys of the prompt's full blocks (see mooncake.hashing);
    the simulator passes the trace's hash_ids instead, which name prefixes the same way.
    priority: lower is more important (vLLM's convention); a request keeps headroom free for
      the operator's SLO classes more important than it (SchedulerConfig.slo_classes).
    ttft_slo_s, tbt_slo_s: this request's own SLOs; None, the config's.
    ends_at_prefill: its whole answer is the one token its prefill samples (max_tokens 1, not
      sampled on the decode side): no decode batch takes it, so decode admission does not refuse
      it when it is prefilled elsewhere.
    """

    request_id: str
    prompt_tokens: int
    block_hashes: tuple[BlockHash, ...] | tuple[int, ...]
    arrival_s: float = 0.0
    priority: int = 0
    ttft_slo_s: float | None = None
    tbt_slo_s: float | None = None
    ends_at_prefill: bool = False


@dataclass(frozen=True, slots=True)
class DecodeSeq:
    """A sequence that occupies (or will occupy) a decode instance's batch.

    start_s is when it began decoding (running) or is expected to arrive (incoming);
    kv_tokens is its KV footprint in tokens. remaining_tokens is how many tokens it still has
    to generate, when the shell knows (a simulator replaying a trace with oracle lengths, or an
    output-length predictor); None, the live default, means unknown. tbt_slo_s is its request's
    TBT SLO, which a request joining its batch must keep; None, the config's. max_tokens is the
    most tokens it may generate in all (the request's max_tokens, which the live shell always
    knows); None, unbounded. It does not tell how long the sequence runs (it may stop at EOS),
    only that it is surely gone once that many steps have run: the forecast uses it as a cap.
    """

    start_s: float
    kv_tokens: int
    remaining_tokens: int | None = None
    tbt_slo_s: float | None = None
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class SeqTotals:
    """What InstanceState derives from a set of sequences (see its fields of the same names)."""

    kv_tokens: int = 0
    lengths_known: bool = True
    tightest_tbt_slo_s: float = math.inf
    any_config_tbt_slo: bool = False
    any_max_tokens: bool = False

    @classmethod
    def of(cls, seqs: tuple[DecodeSeq, ...]) -> "SeqTotals":
        return cls(kv_tokens=sum(s.kv_tokens for s in seqs),
                   lengths_known=all(s.remaining_tokens is not None for s in seqs),  # stops at the first unknown
                   tightest_tbt_slo_s=min((s.tbt_slo_s for s in seqs if s.tbt_slo_s is not None), default=math.inf),
                   any_config_tbt_slo=any(s.tbt_slo_s is None for s in seqs),  # stops at the first
                   any_max_tokens=any(s.max_tokens is not None for s in seqs))  # stops at the first

    def plus(self, other: "SeqTotals") -> "SeqTotals":
        return SeqTotals(self.kv_tokens + other.kv_tokens, self.lengths_known and other.lengths_known,
                         min(self.tightest_tbt_slo_s, other.tightest_tbt_slo_s),
                         self.any_config_tbt_slo or other.any_config_tbt_slo,
                         self.any_max_tokens or other.any_max_tokens)


@dataclass(frozen=True, slots=True)
class InstanceState:
    """Load report of one instance at the time of the snapshot.

    queued_prefill_s: predicted seconds of prefill work queued or running there (its queue
      drains at one second per second). Decode instances report the colocated prefills they
      have been given here.
    running: sequences decoding now. incoming: sequences already assigned to this decode
      instance whose prefill has not finished yet (start_s = predicted arrival).
    kv_capacity_tokens: KV room of the decode batch (or of the prefill pool's cache).
    bandwidth_Bps: measured outgoing transfer bandwidth in bytes per second.
    pending_send_bytes: bytes already queued on its outgoing link (sender congestion).
    prefill_scale, decode_scale: this instance's measured speed relative to the scheduler's
      prior estimators (conductor.core.calibration): its prefill and decode-step times are the
      prior's times these. 1.0, the default, prices it with the prior (the simulator's case).
    chunk_tokens: new tokens per engine step when it prefills beside a running batch (vLLM's
      max_num_batched_tokens there); 0, the default, means the config's chunk_tokens.
    serves_fetches: other instances can pull prefix blocks from it (a live worker whose KVCache
      pool serves other nodes); False: it is never a fetch_from, whatever it holds.
    """

    instance_id: str
    role: Role
    queued_prefill_s: float = 0.0
    running: tuple[DecodeSeq, ...] = ()
    incoming: tuple[DecodeSeq, ...] = ()
    kv_capacity_tokens: int = 1 << 62
    bandwidth_Bps: float = 1e10
    pending_send_bytes: float = 0.0
    prefill_scale: float = 1.0
    decode_scale: float = 1.0
    chunk_tokens: int = 0
    serves_fetches: bool = True
    incoming_totals: SeqTotals | None = field(default=None, repr=False, compare=False)
    """SeqTotals.of(incoming) when the shell keeps it as sequences come and go (the simulator,
    with thousands on their way in an overloaded run); None: summed here."""
    kv_tokens: int = field(init=False)
    """KV tokens of the running sequences (derived; summed once here, read per decision)."""
    incoming_kv_tokens: int = field(init=False)
    lengths_known: bool = field(init=False)
    """Every running and incoming sequence carries remaining_tokens (derived)."""
    tightest_tbt_slo_s: float = field(init=False)
    """The lowest tbt_slo_s among the running and incoming sequences that carry one; inf if none
    does (derived). See admission.batch_tbt_slo_s."""
    any_config_tbt_slo: bool = field(init=False)
    """Some running or incoming sequence has no tbt_slo_s of its own: the config's (derived)."""
    any_max_tokens: bool = field(init=False)
    """Some running or incoming sequence carries max_tokens (derived; the simulator's never do,
    so the forecast skips its cap there)."""

    def __post_init__(self) -> None:
        running = SeqTotals.of(self.running)
        incoming = self.incoming_totals if self.incoming_totals is not None else SeqTotals.of(self.incoming)
        both = running.plus(incoming)
        object.__setattr__(self, "kv_tokens", running.kv_tokens)
        object.__setattr__(self, "incoming_kv_tokens", incoming.kv_tokens)
        object.__setattr__(self, "lengths_known", both.lengths_known)
        object.__setattr__(self, "tightest_tbt_slo_s", both.tightest_tbt_slo_s)
        object.__setattr__(self, "any_config_tbt_slo", both.any_config_tbt_slo)
        object.__setattr__(self, "any_max_tokens", both.any_max_tokens)

    @property
    def batch_size(self) -> int:
        return len(self.running)


@dataclass(frozen=True, slots=True)
class ClusterState:
    """Snapshot of every instance plus the global prefix index.

    pending: blocks of prefills already dispatched but not finished, per instance (the shell
    keeps it; None = not tracked). A request queued behind them reuses them there.
    mean_decode_s is the measured mean time a request spends decoding; prediction-based
    admission assumes every request decodes for this long (paper section 6.4). None means
    "not measured yet" and the scheduler falls back to its configured default.
    """

    instances: tuple[InstanceState, ...]
    index: PrefixIndex
    mean_decode_s: float | None = None
    pending: PendingPrefixes | None = None
    prefill: tuple[InstanceState, ...] = field(init=False)
    decode: tuple[InstanceState, ...] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefill", tuple(i for i in self.instances if i.role is Role.PREFILL))
        object.__setattr__(self, "decode", tuple(i for i in self.instances if i.role is Role.DECODE))


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to run a request. prefill_instance == decode_instance means the prompt is
    prefilled on the decode instance itself (conditional disaggregation, paper section 4).

    fetch_from names the instance to pull fetched_blocks prefix blocks from before prefill
    (hot-spot migration); None means use only what prefill_instance holds.
    """

    request_id: str
    prefill_instance: str
    decode_instance: str
    cached_prefix_tokens: int
    fetch_from: str | None
    fetched_blocks: int
    predicted_ttft_s: float
    predicted_tbt_s: float
    predicted_queue_s: float
    predicted_prefill_s: float
    predicted_transfer_s: float
    best_effort: bool = False  # misses the TTFT SLO even idle; admitted as no prefill was queued

    @property
    def colocated(self) -> bool:
        return self.prefill_instance == self.decode_instance


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal; retry_after_s is when the predicted queues will have drained enough.

    retry_can_help is False when no wait would do: the request misses the SLO even on an idle
    cluster (its own prefill and transfer take longer than the TTFT SLO, or no decode instance
    could hold it empty). retry_after_s is then the configured ceiling. unattainable: it misses
    the TTFT SLO even on an idle cluster; with best_effort_when_idle a retry once every queue has
    drained is served, best effort (retry_can_help stays True). slot_s: how long a retry of this
    request keeps the resource it waits for busy, shared over that resource's instances (its
    predicted prefill over the instances that may prefill it; the mean gap between decode
    departures), which the shell's RetryBook spaces the retries of a burst of refusals by.
    """

    request_id: str
    reason: RejectReason
    retry_after_s: float
    predicted_ttft_s: float | None = None
    predicted_tbt_s: float | None = None
    retry_can_help: bool = True
    unattainable: bool = False
    slot_s: float = 0.0
