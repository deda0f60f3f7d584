"""Per-rank tensors: state that is not the same on every rank, saved and restored per rank.

DCP saves a plain (non-DTensor) tensor once, as if every rank held the same copy. Much
state is like that, but not all: BatchNorm running statistics under FSDP2 (each rank
normalizes its own micro-batches), an EMA of local shards, a per-rank counter. Saved
as replicated, every rank resumed with one rank's copy, silently.

At each durable save the manager compares a crc32c of every module buffer and every
tensor of a Stateful or plain value across ranks (one all_gather of small strings; not
module parameters or optimizer state, replicated by construction) and saves those that
differ, plus every tensor under a key declared with :class:`PerRank`, under
``per_rank.rank_R`` - one entry per rank, as the RNG state is. The manifest's manager record lists them.

Resume: on the same world size each rank gets its own copy back, bitwise. On another
world size new rank ``r`` takes the copy of old rank ``r % old_world_size`` (for
BatchNorm statistics any rank's are an estimate of the same thing), and rank 0 says so
at WARNING naming the tensors.

Pure helpers over nested state dicts; the collective lives in the manager.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from ckpt.format.checksum import crc32c_of

PER_RANK_KEY = "per_rank"
"""Reserved top-level state key holding ``{"rank_R": {path: tensor}}``."""
PATH_SEP = "/"


class PerRank:
    """Declare a state value per-rank: every tensor in it is saved for each rank apart.

    ``CheckpointManager(root, {"model": model, "ema": ckpt.PerRank(local_ema)})``: use it
    for state that differs between ranks by nature, even where it happens to be equal
    at a save. The wrapped object is checkpointed as it would be unwrapped.
    """

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r})"


def rank_key(rank: int) -> str:
    return f"rank_{rank}"


def plain_tensors(state: dict[str, Any], skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """Every non-DTensor tensor in nested dicts, by ``/``-joined path (keys in ``skip`` left out)."""
    found: dict[str, torch.Tensor] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, DTensor):
            return
        if isinstance(node, torch.Tensor):
            found[PATH_SEP.join(path)] = node
        elif isinstance(node, dict):
            for key, value in node.items():
                if not path and key in skip:
                    continue
                walk(value, (*path, str(key)))

    walk(state, ())
    return found


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """crc32c of each tensor's bytes (shape and dtype included), to compare across ranks."""
    out = {}
    for path, tensor in tensors.items():
        data = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[path] = f"{crc32c_of(memoryview(data))}:{tuple(tensor.shape)}:{tensor.dtype}"
    return out


def differing(gathered: list[dict[str, str]]) -> set[str]:
    """Paths whose digest is not the same on every rank (or missing on some)."""
    paths = set().union(*gathered) if gathered else set()
    return {p for p in paths if len({g.get(p) for g in gathered}) > 1}


def _pop(state: dict[str, Any], path: str) -> Any:
    """Remove ``path``; every dict on the way is replaced by a copy (a user's plain dict
    in the state is never changed)."""
    *parents, leaf = path.split(PATH_SEP)
    node = state
    for key in parents:
        node[key] = dict(node[key])
        node = node[key]
    return node.pop(leaf)


def _put(state: dict[str, Any], path: str, value: Any) -> None:
    *parents, leaf = path.split(PATH_SEP)
    node = state
    for key in parents:
        node = node[key]
    node[leaf] = value


def move_out(state: dict[str, Any], paths: list[str], rank: int) -> None:
    """Move ``paths`` of ``state`` under ``state[per_rank][rank_R]`` (save and load template)."""
    if not paths:
        return
    mine = state.setdefault(PER_RANK_KEY, {}).setdefault(rank_key(rank), {})
    for path in paths:
        mine[path] = _pop(state, path)


def move_back(state: dict[str, Any], paths: list[str], rank: int) -> None:
    """Undo :func:`move_out` on a loaded template (the tensors go back to their paths)."""
    if not paths:
        return
    mine = state[PER_RANK_KEY][rank_key(rank)]
    for path in paths:
        _put(state, path, mine[path])
    del state[PER_RANK_KEY]


def source_rank(rank: int, old_world_size: int, new_world_size: int) -> int:
    """Whose per-rank copy a rank restores: its own on the same world size, else ``r % old``."""
    return rank if old_world_size == new_world_size else rank % old_world_size
