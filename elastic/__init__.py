"""torchrun / torch.distributed.elastic integration for the trainer.

Run identity from the environment, job-wide restart count, fault injection,
SIGTERM (preemption) handling, hang watchdog, peer failure detection (heartbeats) and
straggler detection, all behind one
``with RunGuard(...)``; ``ElasticSampler``, a data position that resumes on any
world size; and ``sample_rng``, dropout keyed by global micro-batch, not by rank. Depends only on
the standard library and torch; never imports `trainer` or `ckpt`.

Names are loaded on first use (PEP 562), so that `elastic.faults`, `elastic.identity`,
`elastic.preemption` and `elastic.watchdog` can be imported without importing torch;
only the collectives (and the straggler monitor) need it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic.distributed import DistContext, close_distributed, init_distributed
    from elastic.events import RunRecorder
    from elastic.faults import (
        ENV_FAULTS,
        FaultKind,
        FaultPlan,
        FaultSpec,
        InjectedFault,
        parse_fault_spec,
    )
    from elastic.guard import EmergencySaver, Preempted, RunGuard
    from elastic.heartbeat import (
        PEER_SILENT_EXIT_CODE,
        PeerHeartbeat,
        SilentVerdict,
        silent_peers,
    )
    from elastic.identity import RunIdentity, job_restart_count, restart_setup_problem
    from elastic.preemption import (
        PreemptionDecision,
        PreemptionHandler,
        PreemptionHandlerError,
        agree_on_preemption,
        decide_emergency_save,
        grace_from_env,
    )
    from elastic.process import exit_now
    from elastic.rng import MicroBatch, MicroBatchSplitError, sample_rng
    from elastic.sampler import ElasticSampler, GlobalOrder, samples_digest
    from elastic.straggler import StragglerMonitor, find_stragglers
    from elastic.watchdog import StallInfo, Watchdog, process_group_timeout

_EXPORTS: dict[str, str] = {
    "DistContext": "elastic.distributed",
    "close_distributed": "elastic.distributed",
    "init_distributed": "elastic.distributed",
    "ENV_FAULTS": "elastic.faults",
    "FaultKind": "elastic.faults",
    "FaultPlan": "elastic.faults",
    "FaultSpec": "elastic.faults",
    "InjectedFault": "elastic.faults",
    "parse_fault_spec": "elastic.faults",
    "EmergencySaver": "elastic.guard",
    "Preempted": "elastic.guard",
    "RunGuard": "elastic.guard",
    "PEER_SILENT_EXIT_CODE": "elastic.heartbeat",
    "PeerHeartbeat": "elastic.heartbeat",
    "SilentVerdict": "elastic.heartbeat",
    "silent_peers": "elastic.heartbeat",
    "ElasticSampler": "elastic.sampler",
    "GlobalOrder": "elastic.sampler",
    "samples_digest": "elastic.sampler",
    "MicroBatch": "elastic.rng",
    "MicroBatchSplitError": "elastic.rng",
    "sample_rng": "elastic.rng",
    "RunIdentity": "elastic.identity",
    "restart_setup_problem": "elastic.identity",
    "RunRecorder": "elastic.events",
    "exit_now": "elastic.process",
    "job_restart_count": "elastic.identity",
    "PreemptionDecision": "elastic.preemption",
    "PreemptionHandler": "elastic.preemption",
    "PreemptionHandlerError": "elastic.preemption",
    "agree_on_preemption": "elastic.preemption",
    "decide_emergency_save": "elastic.preemption",
    "grace_from_env": "elastic.preemption",
    "StragglerMonitor": "elastic.straggler",
    "find_stragglers": "elastic.straggler",
    "StallInfo": "elastic.watchdog",
    "Watchdog": "elastic.watchdog",
    "process_group_timeout": "elastic.watchdog",
}

__all__ = [
    "ENV_FAULTS",
    "PEER_SILENT_EXIT_CODE",
    "DistContext",
    "ElasticSampler",
    "EmergencySaver",
    "FaultKind",
    "FaultPlan",
    "FaultSpec",
    "GlobalOrder",
    "InjectedFault",
    "MicroBatch",
    "MicroBatchSplitError",
    "PeerHeartbeat",
    "Preempted",
    "PreemptionDecision",
    "PreemptionHandler",
    "PreemptionHandlerError",
    "RunGuard",
    "RunIdentity",
    "RunRecorder",
    "SilentVerdict",
    "StallInfo",
    "StragglerMonitor",
    "Watchdog",
    "agree_on_preemption",
    "close_distributed",
    "decide_emergency_save",
    "exit_now",
    "find_stragglers",
    "grace_from_env",
    "init_distributed",
    "job_restart_count",
    "parse_fault_spec",
    "process_group_timeout",
    "restart_setup_problem",
    "sample_rng",
    "samples_digest",
    "silent_peers",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
