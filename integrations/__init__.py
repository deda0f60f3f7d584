"""Plug-ins that give a framework's own training loop this project's checkpoints.

- :mod:`integrations.lightning`: a Lightning ``Callback`` (``pytorch_lightning``);
- :mod:`integrations.hf_trainer`: a ``transformers.Trainer`` callback.

Each plug-in builds a :class:`ckpt.CheckpointManager` and an :class:`elastic.RunGuard`
over what the framework keeps (model, optimizers, schedulers, loop position) and drives
them from the framework's hooks; the framework stays an optional dependency, imported by
its plug-in only.
"""
