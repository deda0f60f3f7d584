"""What ``ckpt``, ``elastic`` and ``trainer`` share: the fault-spec grammar and the event schema.

Standard library only and imports nothing else of this repository, so both ``ckpt``
and ``elastic`` (which never import each other) build on it: ``runcore.faultspec``
(the ``NAME[:key=value]...`` grammar of every fault spec) and ``runcore.events`` (the
name and fields of every event written to a run's event log, for writers and readers).
"""
