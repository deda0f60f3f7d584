"""Fault-tolerant elastic GPT trainer on FSDP2: config, model, data, loop, resumable state.

Run it with ``python -m trainer --config FILE.toml`` (one process) or under torchrun.
``TrainConfig`` and ``load_config`` are loaded on first use (PEP 562): ``python -m trainer``
looks at the job's restart notes before anything imports torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from trainer import config

        return getattr(config, name)
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
