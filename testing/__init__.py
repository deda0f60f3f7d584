"""Test and benchmark harnesses: code that no runtime path of the trainer imports.

``local_cluster`` (real torchrun agents on one machine), ``spawn`` (a function on N
gloo ranks), ``gcs_emulator`` (fake-gcs-server started and stopped locally) and
``ports`` (free loopback ports). Used by ``tests/``, ``bench/`` and the examples, run
from the repository root. Not shipped: pyproject.toml's package list leaves it out.
"""
