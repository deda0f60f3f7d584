"""Elastic-deterministic data: a token stream cut into samples, in a global order.

The global sample order is a function of (seed, epoch) only, and the only state is one
global cursor: the number of samples consumed so far by the whole job. Step ``s`` takes
the next ``global_batch`` positions from the cursor; every micro-batch is a contiguous
run of ``micro_batch`` positions, and rank ``r`` of ``W`` takes the micro-batches
``r*A .. r*A+A-1`` (``A`` = accumulation steps). The micro-batches of a step are therefore
the same at every world size; only which rank computes them changes, so nothing is keyed
by rank and the job can resume on any world size at the same global position. The order
itself is ``elastic.sampler.GlobalOrder``, the one behind the public ``ElasticSampler``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import fsspec
import numpy as np
import torch
from fsspec.implementations.local import LocalFileSystem

from elastic.sampler import GlobalOrder, samples_digest
from trainer.config import DataConfig
from trainer.corpus import arithmetic_tokens

logger = logging.getLogger(__name__)

BUILTIN_SOURCE = "arithmetic"


class BatchLayoutError(ValueError):
    """The global batch cannot be split evenly over the ranks and micro-batches."""


@dataclass(frozen=True, slots=True)
class BatchLayout:
    """How one global batch is split: per rank, ``accum`` micro-batches of ``micro`` samples."""

    global_batch: int
    micro: int
    world_size: int
    accum: int

    @classmethod
    def plan(cls, global_batch: int, micro: int, world_size: int) -> BatchLayout:
        """Gradient accumulation for ``world_size`` ranks; ``BatchLayoutError`` if not integral."""
        per_step = world_size * micro
        if global_batch % per_step != 0:
            raise BatchLayoutError(
                f"data.global_batch={global_batch} is not divisible by world_size*data.micro_batch"
                f" = {world_size}*{micro} = {per_step}; choose a global batch that is a multiple"
                f" of micro_batch times every world size you run on (e.g. {micro * 12} for 1-4 ranks)"
            )
        return cls(global_batch, micro, world_size, global_batch // per_step)


@dataclass(frozen=True, slots=True)
class TokenSamples:
    """A token stream cut into non-overlapping samples of ``seq_len + 1`` tokens.

    Sample ``i`` is ``tokens[i*seq_len : i*seq_len + seq_len + 1]`` (input and shifted target).
    """

    tokens: np.ndarray
    seq_len: int
    vocab_size: int

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def get(self, ids: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64, ``[len(ids), seq_len]``) of the given sample ids."""
        rows = np.stack(
            [self.tokens[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in ids]
        )
        block = torch.from_numpy(rows.astype(np.int64))
        return block[:, :-1], block[:, 1:]


def load_token_file(url: str) -> np.ndarray:
    """Read a nanoGPT-style flat uint16 token file from a local path or any fsspec URL."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise FileNotFoundError(f"data.source={url!r}: token file not found")
    if isinstance(fs, LocalFileSystem):
        return np.memmap(path, dtype=np.uint16, mode="r")
    with fs.open(path, "rb") as fh:
        return np.frombuffer(fh.read(), dtype=np.uint16)


def build_samples(cfg: DataConfig, seq_len: int, vocab_size: int) -> TokenSamples:
    """The dataset named by ``cfg.source``; ``vocab_size`` 0 means infer it from the data."""
    if cfg.source == BUILTIN_SOURCE:
        tokens, tokenizer = arithmetic_tokens(cfg.seed, cfg.corpus_chars)
        data_vocab = tokenizer.vocab_size
    else:
        tokens = load_token_file(cfg.source)
        data_vocab = int(tokens.max()) + 1 if len(tokens) else 0
    vocab = vocab_size or data_vocab
    if data_vocab > vocab:
        raise ValueError(
            f"model.vocab_size={vocab_size} is smaller than the data's {data_vocab} token ids"
        )
    samples = TokenSamples(tokens=tokens, seq_len=seq_len, vocab_size=vocab)
    if len(samples) < 1:
        raise ValueError(
            f"data.source={cfg.source!r} has fewer than seq_len+1={seq_len + 1} tokens"
        )
    return samples


def micro_batch_ids(
    order: GlobalOrder, cursor: int, layout: BatchLayout, rank: int
) -> list[np.ndarray]:
    """Sample ids of this rank's micro-batches for the step starting at ``cursor``.

    The global batch is ``global_batch`` contiguous positions; micro-batch ``j`` of the step
    covers positions ``cursor + j*micro ..``, and rank ``r`` computes ``j = r*accum + k``.
    """
    first = cursor + rank * layout.accum * layout.micro
    ids = order.sample_ids(first, layout.accum * layout.micro)
    return [ids[k * layout.micro : (k + 1) * layout.micro] for k in range(layout.accum)]


__all__ = [
    "BatchLayout",
    "BatchLayoutError",
    "GlobalOrder",
    "TokenSamples",
    "build_samples",
    "load_token_file",
    "micro_batch_ids",
    "samples_digest",
]
