"""The one grammar of every fault spec in this project: ``NAME[:key=value]...``.

``elastic.faults`` (``TRAINER_FAULTS``, ``--fault``) and ``ckpt.storage.faults``
(``CKPT_STORAGE_FAULTS``) both split their specs with :func:`split_fault_spec` and check
the name and keys themselves. Pure; standard library only.
"""

from __future__ import annotations


def split_fault_spec(text: str) -> tuple[str, dict[str, str]]:
    """Split one `NAME[:key=value]...` spec into its name and fields (pure).

    The grammar of every fault spec in the project. Raises ValueError (with the reason
    only) for a field that is not key=value or a key given twice.
    """
    name, *parts = (part.strip() for part in text.strip().split(":"))
    fields: dict[str, str] = {}
    for part in parts:
        key, sep, raw = part.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"{part!r} is not key=value")
        if key in fields:
            raise ValueError(f"key {key!r} given twice")
        fields[key] = raw.strip()
    return name, fields
