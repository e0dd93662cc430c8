"""The KVCache-centric scheduler core: pure, clock-explicit, I/O-free (see docs/SCHEDULER.md)."""

from conductor.core.config import Admission, Policy, SchedulerConfig, SLOClass
from conductor.core.estimators import DecodeModel, Estimators, PrefillModel
from conductor.core.index import EventKind, KVEvent, PendingPrefixes, PrefixIndex
from conductor.core.profile_table import ProfileTable, load_profile, paper_scale_profile
from conductor.core.scheduler import Scheduler
from conductor.core.types import (ClusterState, Decision, DecodeSeq, InstanceState, Rejection, RejectReason,
                                  Request, Role)

__all__ = [
    "Admission", "ClusterState", "Decision", "DecodeModel", "DecodeSeq", "Estimators", "EventKind", "InstanceState",
    "KVEvent", "PendingPrefixes", "Policy", "PrefillModel", "PrefixIndex", "ProfileTable", "Rejection",
    "RejectReason", "Request", "Role", "SLOClass", "Scheduler", "SchedulerConfig", "load_profile",
    "paper_scale_profile",
]
