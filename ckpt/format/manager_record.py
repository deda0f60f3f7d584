"""The schema of the manager record a ``CheckpointManager`` writes into a manifest.

``manifest.metadata["ckpt_manager"]`` says what a resume needs before it reads a tensor:
the state's keys, the optimizers saved fresh, the tensor shapes (the shape check), the
paths saved per rank, whether RNG state is there, the tied parameters. A resume
computes its load template from it, so a record of the wrong shape (``fresh_optimizers:
7``, ``shapes: [1, 2]``) used to raise ``TypeError`` out of every attempt of the job.
:func:`record_problems` checks it as data; discovery calls a checkpoint whose record
fails it *damaged* (set aside and quarantined by a resume, FAIL in ``verify``), so
nothing of it is ever used. Pure.
"""

from __future__ import annotations

from typing import Any

RECORD_KEY = "ckpt_manager"
"""Where the record lives in the manifest's metadata."""


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _shapes(value: Any) -> bool:
    if not isinstance(value, dict):
        return False
    for key, tensors in value.items():
        if not isinstance(key, str) or not isinstance(tensors, dict):
            return False
        for name, shape in tensors.items():
            if not isinstance(name, str) or not isinstance(shape, list):
                return False
            if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
                return False
    return True


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    )


def _tied(value: Any) -> bool:
    """``{state key: {tied name: the name it is stored under}}``."""
    return isinstance(value, dict) and all(
        isinstance(k, str) and _str_map(v) for k, v in value.items()
    )


_FIELDS: dict[str, tuple[Any, str]] = {
    "keys": (_str_list, "a list of names"),
    "fresh_optimizers": (_str_list, "a list of names"),
    "per_rank": (_str_list, "a list of state paths"),
    "rng": (lambda v: isinstance(v, bool | int), "true or false"),
    "shapes": (_shapes, "{key: {tensor: [sizes >= 0]}}"),
    "tied": (_tied, "{key: {name: name}}"),
    "data_position": (lambda v: isinstance(v, dict), "a mapping"),
}


def record_problems(metadata: Any) -> list[str]:
    """What is wrong with the manager record in a manifest's ``metadata`` (empty: nothing;
    a manifest without a record, from ``ckpt.save``, has nothing wrong)."""
    if not isinstance(metadata, dict) or RECORD_KEY not in metadata:
        return []
    record = metadata[RECORD_KEY]
    if not isinstance(record, dict):
        return [f"the manager record is a {type(record).__name__}, not a mapping"]
    problems = []
    for name, (valid, expected) in _FIELDS.items():
        if name in record and not valid(record[name]):
            shown = repr(record[name])
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            problems.append(f"manager record field {name!r} is {shown}, not {expected}")
    return problems
