"""Free loopback ports for the tests: :mod:`bench.harness.ports` (shipped with ``bench``)."""

from __future__ import annotations

from bench.harness.ports import free_port

__all__ = ["free_port"]
