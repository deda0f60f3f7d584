"""Warm restarts under plain ``torchrun``: workers forked from a per-node interpreter that
already imported torch.

A restart after a fault pays, before its first step, for a fresh interpreter importing
torch, ``torch.distributed``, FSDP, DCP and (lazily, on the first ``fully_shard``)
``torch._dynamo``: about 3 s per worker on a small machine, most of what a restart costs.
Run the training entry point through this launcher and a restart skips it::

    torchrun --nnodes=2:4 --nproc_per_node=4 --max_restarts=3 ... \\
        -m warmstart -m trainer --config examples/tiny_gpt.toml

    torchrun ... -m warmstart examples/bring_your_own_model.py --ckpt-dir ...

What happens (``docs/design.md``, "Warm restarts"):

- Each worker torchrun starts is a *launcher*: a small interpreter that imports nothing
  heavy. It looks for this node's *zygote* (one per torchrun agent, found by a Unix
  socket named after the agent's pid and the run id, in this user's private directory:
  ``protocol.runtime_dir``).
- None yet (the first attempt): the launcher starts one in the background and runs the
  target itself, in-process, exactly like ``python -m trainer`` would.
- A zygote is ready (every later attempt): it forks a child with the launcher's argv,
  environment, working directory and stdin/stdout/stderr. The launcher forwards
  catchable signals (SIGTERM, SIGINT, ...) to it and exits with its exit code or signal,
  so torchrun sees what it would see of a plain worker. The zygote mirrors the
  launcher's fate onto the child: the launcher killed -> the child SIGKILLed; the
  launcher stopped (SIGSTOP) -> the child stopped, and continued with it.

The zygote imports torch and friends (unwatched) and this project's library, ``ckpt`` and
``elastic``, plus any ``--preload`` module (watched): when a watched module's source file
changes between two attempts, the next worker runs cold with the new code and a fresh
zygote takes over. The target itself is imported fresh by every worker.

Outside ``torchrun`` (no ``TORCHELASTIC_RUN_ID``) or with ``--cold``, the launcher just runs
the target in-process. This package imports nothing but the standard library.
"""

from __future__ import annotations

__all__: list[str] = []
