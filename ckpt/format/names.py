"""How a module's tensors are named in a checkpoint: DCP's names, and tied parameters.

DCP's ``get_model_state_dict`` names a tensor as the user's module does, without the
prefixes of the wrappers around it (DDP's ``module.``, ``torch.compile``'s
``_orig_mod.``, activation checkpointing's): ``net.0.weight``, not
``module.net.0.weight``. The manager's shape record, its error messages, the stored
keys and the exported names all use these names (:func:`canonical_name`).

Tied parameters - one ``Parameter`` under two names, such as an embedding shared with
the output layer (``transformers``' ``tie_word_embeddings``) - are stored once, under
their first name in ``named_parameters`` order (``model.embed_tokens.weight``, the one
``save_pretrained`` keeps), and each other name is recorded as an alias of it
(:func:`tied_aliases`); a load gives the alias the loaded tensor back, and the model
keeps the one parameter it had. DCP itself stores each name in full (a tied 8 MB
embedding took 16 MB), as ``torch.save`` of a state dict does not.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

try:  # DCP's name mapping (private, stable since torch 2.2; pinned by constraints.txt)
    from torch.distributed.checkpoint.state_dict import _get_fqns
except ImportError:  # pragma: no cover - a torch without it: names stay as the module gives them
    _get_fqns = None


def canonical_name(module: torch.nn.Module, name: str) -> str:
    """DCP's name of ``module``'s tensor ``name`` (a ``state_dict`` or parameter name).

    A name that does not resolve in ``module`` (a record of another model) is returned
    as given.
    """
    if _get_fqns is None:
        return name
    try:
        fqns = _get_fqns(module, name)
    except (AssertionError, AttributeError, KeyError):
        return name
    return next(iter(fqns)) if len(fqns) == 1 else name


def canonical_shapes(module: torch.nn.Module) -> dict[str, list[int]]:
    """Global shape of every tensor of ``module``'s ``state_dict``, by DCP name."""
    return {canonical_name(module, n): list(t.shape) for n, t in module.state_dict().items()}


def canonical_record(module: torch.nn.Module, shapes: dict[str, list[int]]) -> dict[str, list[int]]:
    """A saved shape record by DCP name: a record written under the wrapper's names (by an
    older version, ``module.net.0.weight``) is mapped onto the names this one compares."""
    return {canonical_name(module, n): s for n, s in shapes.items()}


def tied_aliases(module: torch.nn.Module) -> dict[str, str]:
    """``{alias: stored name}`` for every parameter of ``module`` that has several names."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        fqn = canonical_name(module, name)
        owner = first.setdefault(id(param), fqn)
        if owner != fqn:
            aliases[fqn] = owner
    return aliases


def drop_aliases(state: dict[str, object], aliases: dict[str, str]) -> None:
    """Remove the aliases from a module's state dict (in place): their owner holds them."""
    for alias, owner in aliases.items():
        if alias in state and owner in state:
            del state[alias]


def restore_aliases(state: dict[str, object], aliases: dict[str, str]) -> None:
    """Give each alias its owner's loaded tensor (in place) before the module loads it."""
    for alias, owner in aliases.items():
        if alias not in state and owner in state:
            state[alias] = state[owner]
