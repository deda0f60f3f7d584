"""Hugging Face conventions of a checkpointed model: its ``config.json`` and generation config.

``transformers``' ``from_pretrained`` needs a ``config.json`` beside the weights, and
``generate`` reads ``generation_config.json``. When a manager's state holds a
``transformers`` ``PreTrainedModel`` (recognised by its ``config.to_json_string`` and
``save_pretrained``; ``transformers`` is never imported here), the manager records both
as ``save_pretrained`` would write them, in the manifest (``hf`` in its record: a few KB
of JSON per model), and ``ckpt export`` writes them next to the safetensors
(:func:`pretrained_files`). An explicit ``--config`` wins over the recorded one.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

logger = logging.getLogger(__name__)

HF_RECORD_KEY = "hf"
"""Entry of the manager's manifest record: ``{state key: {"config": {...}, ...}}``."""
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
_FILES = {"config": CONFIG_FILE, "generation_config": GENERATION_CONFIG_FILE}


def model_class_name(module: torch.nn.Module) -> str:
    """The user's class name of ``module`` (FSDP2 wraps the class in ``FSDP<Name>``)."""
    for cls in type(module).__mro__:
        if not issubclass(cls, FSDPModule):
            return cls.__name__
    return type(module).__name__  # pragma: no cover - FSDPModule alone is never a model


def pretrained_record(module: torch.nn.Module) -> dict[str, Any] | None:
    """``{"config": ..., "generation_config": ...}`` of a ``PreTrainedModel``, else None.

    The config as ``save_pretrained`` writes it (the values that differ from the
    defaults, ``architectures`` set to the model's class); the generation config when
    the model has one.
    """
    config = getattr(module, "config", None)
    if not callable(getattr(module, "save_pretrained", None)) or not callable(
        getattr(config, "to_json_string", None)
    ):
        return None
    try:
        record: dict[str, Any] = {"config": json.loads(config.to_json_string())}
    except (TypeError, ValueError) as exc:  # a config that does not serialise: say, go on
        logger.warning(
            "ckpt: the model's config does not serialise to JSON (%s); not recorded", exc
        )
        return None
    if not record["config"].get("architectures"):
        record["config"]["architectures"] = [model_class_name(module)]
    generation = getattr(module, "generation_config", None)
    if callable(getattr(generation, "to_json_string", None)):
        try:
            record["generation_config"] = json.loads(generation.to_json_string())
        except (TypeError, ValueError):
            pass  # optional: from_pretrained rebuilds a default one
    return record


CODE_POINTING_KEYS = ("auto_map", "custom_pipelines")
"""Config keys that name Python code for ``trust_remote_code`` to import and run."""


def _without_code_pointers(body: dict[str, Any], filename: str) -> dict[str, Any]:
    """``body`` without :data:`CODE_POINTING_KEYS` (said at WARNING): a recorded config is
    read from a checkpoint, untrusted, and ``from_pretrained(..., trust_remote_code=True)``
    would run the code they name."""
    dropped = [k for k in CODE_POINTING_KEYS if k in body]
    if not dropped:
        return body
    logger.warning(
        "ckpt export: %s left out of %s: %s name%s code that trust_remote_code would run, and "
        "a checkpoint's record is not trusted; add %s back by hand if the code is yours",
        ", ".join(dropped), filename, " and ".join(dropped), "s" if len(dropped) == 1 else "",
        "it" if len(dropped) == 1 else "them",
    )  # fmt: skip
    return {k: v for k, v in body.items() if k not in dropped}


def pretrained_files(
    manager_record: dict[str, Any], model_key: str, dtype: torch.dtype | None = None
) -> dict[str, bytes]:
    """The ``config.json`` / ``generation_config.json`` recorded for ``model_key``, as bytes.

    ``dtype``: the export's cast; the config then names it (``dtype``, or
    ``torch_dtype`` for a config of transformers 4), so ``from_pretrained(dtype="auto")``
    loads it as exported.
    """
    record = manager_record.get(HF_RECORD_KEY, {})
    entry = record.get(model_key) if isinstance(record, dict) else None
    if not isinstance(entry, dict):
        return {}
    out: dict[str, bytes] = {}
    for key, filename in _FILES.items():
        body = entry.get(key)
        if not isinstance(body, dict):
            continue
        body = _without_code_pointers(body, filename)
        if key == "config" and dtype is not None:
            body = dict(body)
            version = str(body.get("transformers_version", "5"))
            field = "torch_dtype" if version.split(".")[0] in ("3", "4") else "dtype"
            body[field] = str(dtype).removeprefix("torch.")
        out[filename] = (json.dumps(body, indent=2, sort_keys=True) + "\n").encode()
    return out
