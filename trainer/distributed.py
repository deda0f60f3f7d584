"""Process-group setup of the trainer: ``elastic.init_distributed`` (public), and a close
that drains the checkpoint library first.

The trainer calls the same public function as a user's script
(``examples/bring_your_own_model.py``); only :func:`close_distributed` adds the
trainer's ``ckpt`` teardown (a background save of the one-off ``ckpt.save`` and its
cached group) before the default group goes.
"""

from __future__ import annotations

import ckpt
from ckpt.dist import release_groups
from elastic import distributed as _elastic_dist
from elastic.distributed import DistContext, init_distributed

__all__ = ["DistContext", "close_distributed", "init_distributed"]


def close_distributed() -> None:
    """Drain ``ckpt``'s background save, drop its group, destroy the default group."""
    ckpt.close()  # drain a background save, if any
    release_groups()
    _elastic_dist.close_distributed()
