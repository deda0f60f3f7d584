"""Leases raced from threads: every holder tries to take the same root at one moment."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ckpt.errors import RootLeaseError


def race(leases: Sequence[Any], timeout_s: float = 30.0) -> list[str]:
    """Each lease's ``acquire()`` in its own thread, released together by a barrier: the
    sorted outcomes, ``"won"`` or ``"refused"`` (a ``RootLeaseError``) per lease."""
    barrier = threading.Barrier(len(leases))
    outcomes: list[str] = []

    def take(item: Any) -> None:
        barrier.wait()
        try:
            item.acquire()
            outcomes.append("won")
        except RootLeaseError:
            outcomes.append("refused")

    threads = [threading.Thread(target=take, args=(item,)) for item in leases]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s)
    return sorted(outcomes)
