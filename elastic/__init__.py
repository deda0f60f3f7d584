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

from runcore.redact import install_log_redaction

install_log_redaction()

if TYPE_CHECKING:
    from elastic.distributed import DistContext, close_distributed, init_distributed
    from elastic.errors import (
        Diverged,
        InjectedFault,
        MicroBatchSplitError,
        Preempted,
        PreemptionHandlerError,
        SamplerStateError,
    )
    from elastic.events import RunRecorder
    from elastic.faults import FaultPlan, parse_fault_spec
    from elastic.guard import EmergencySaver, RunGuard
    from elastic.heartbeat import PEER_SILENT_EXIT_CODE
    from elastic.process import exit_now
    from elastic.rng import MicroBatch, sample_rng
    from elastic.sampler import ElasticSampler, samples_digest

_EXPORTS: dict[str, str] = {
    "DistContext": "elastic.distributed",
    "close_distributed": "elastic.distributed",
    "init_distributed": "elastic.distributed",
    "FaultPlan": "elastic.faults",
    "InjectedFault": "elastic.errors",
    "parse_fault_spec": "elastic.faults",
    "EmergencySaver": "elastic.guard",
    "Preempted": "elastic.errors",
    "Diverged": "elastic.errors",
    "RunGuard": "elastic.guard",
    "PEER_SILENT_EXIT_CODE": "elastic.heartbeat",
    "ElasticSampler": "elastic.sampler",
    "samples_digest": "elastic.sampler",
    "MicroBatch": "elastic.rng",
    "MicroBatchSplitError": "elastic.errors",
    "sample_rng": "elastic.rng",
    "RunRecorder": "elastic.events",
    "exit_now": "elastic.process",
    "PreemptionHandlerError": "elastic.errors",
    "SamplerStateError": "elastic.errors",
}
"""The public names: what a training script needs. Everything else is reachable in its
module (``elastic.watchdog.Watchdog``, ``elastic.identity.RunIdentity``, ...)."""

__all__ = [
    "PEER_SILENT_EXIT_CODE",
    "DistContext",
    "Diverged",
    "ElasticSampler",
    "EmergencySaver",
    "FaultPlan",
    "InjectedFault",
    "MicroBatch",
    "MicroBatchSplitError",
    "Preempted",
    "PreemptionHandlerError",
    "RunGuard",
    "RunRecorder",
    "SamplerStateError",
    "close_distributed",
    "exit_now",
    "init_distributed",
    "parse_fault_spec",
    "sample_rng",
    "samples_digest",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'elastic' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
