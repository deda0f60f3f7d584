"""Fault-tolerant elastic GPT trainer on FSDP2: config, model, data, loop, resumable state.

Run it with ``python -m trainer --config FILE.toml`` (one process) or under torchrun.
"""

from __future__ import annotations

from trainer.config import TrainConfig, load_config

__all__ = ["TrainConfig", "load_config"]
