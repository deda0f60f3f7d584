"""Test and benchmark harnesses: code that no runtime path of the trainer imports.

``local_cluster`` (real torchrun agents on one machine), ``spawn`` (a function on N
gloo ranks), ``gcs_emulator`` (fake-gcs-server started and stopped locally) and
``ports`` (free loopback ports), ``netns``, ``procs``, ``mounts``, ``slurm``, ``leases``. Used by
``tests/`` and the examples, run from the repository root. Not shipped: pyproject.toml's
package list leaves it out. What the bench runs (``spawn``, ``local_cluster``,
``gcs_emulator``, ``ports``) lives in ``bench`` (``bench.spawn``, ``bench.harness``), which
is shipped, and is re-exported here.
"""
