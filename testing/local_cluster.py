"""The local elastic cluster of the tests: :mod:`bench.harness.local_cluster` (shipped with
``bench``, whose elastic group runs it from an installed wheel too)."""

from __future__ import annotations

from bench.harness.local_cluster import (
    BACKENDS,
    FT_RDZV_CONF,
    RDZV_CONF,
    REPO,
    Agent,
    ElasticJob,
    Wrap,
    descendants,
    read_jsonl,
)

__all__ = [
    "BACKENDS", "FT_RDZV_CONF", "RDZV_CONF", "REPO", "Agent", "ElasticJob", "Wrap", "descendants",
    "read_jsonl",
]  # fmt: skip
