"""Random numbers drawn in ``Dataset.__getitem__`` (augmentation), replayed exactly.

A vision ``Dataset`` draws a random crop and flip per sample, in ``DataLoader`` worker
processes. Each worker's random streams start from a seed torch draws from the loader's
generator when the worker starts, and advance with every sample it serves, so the
numbers a sample gets depend on which worker served it, how many samples that worker
served before, whether workers persist across epochs, and where the run was resumed:
after a resume the augmentations differ from the uninterrupted run's, silently.

Here each sample's draws depend on its global position in the data stream only: the
sampler hands out :class:`SampleKey` indices (an ``int`` that also carries the
position), and :class:`SeededDataset` runs ``__getitem__`` with ``torch``'s CPU
generator, ``random`` and ``numpy``'s global generator seeded from (seed, position),
giving the caller's states back afterwards. The same sample at the same position gets
the same numbers on any worker count, persistent or not, any world size, before and
after any resume. ``ElasticSampler.loader()`` and ``epoch_loader()`` do it by default;
a user's own ``DataLoader`` over an ``ElasticSampler`` gets it with one change,
``DataLoader(sampler.seeded(dataset), sampler=sampler, ...)``. A ``DataLoader`` with
workers over an ``ElasticSampler`` without it is said at WARNING at the first save
(:func:`note_loader`, from the loader-worker hook of :mod:`elastic.loader_workers`).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

SAMPLE_STREAM = 0x5A
"""The stream of :func:`elastic.rng.derive_seed` for per-sample seeds (dropout has its own)."""


class SampleKey(int):
    """A dataset index that carries its global sample position (``key.position``).

    It is the index everywhere an ``int`` is expected (a plain ``Dataset`` indexes with
    it unchanged); :class:`SeededDataset` reads the position."""

    position: int

    def __new__(cls, index: int, position: int) -> SampleKey:
        key = super().__new__(cls, index)
        key.position = int(position)
        return key

    def __reduce__(self) -> tuple[Any, tuple[int, int]]:  # to a worker process and back
        return (SampleKey, (int(self), self.position))

    def __repr__(self) -> str:
        return f"SampleKey({int(self)}, position={self.position})"


def seed_draws(seed: int) -> None:
    """``torch``'s default CPU generator, ``random`` and ``numpy``'s global generator
    seeded from ``seed``."""
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed & 0xFFFF_FFFF)


@contextlib.contextmanager
def seeded_draws(seed: int) -> Iterator[None]:
    """Inside: the generators seeded from ``seed`` (:func:`seed_draws`); on exit (or an
    error) each gets its state back."""
    torch_state = torch.default_generator.get_state()
    random_state = random.getstate()
    numpy_state = np.random.get_state()
    seed_draws(seed)
    try:
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        random.setstate(random_state)
        np.random.set_state(numpy_state)


class SeededDataset:
    """``dataset`` whose ``__getitem__`` draws from streams seeded by the sample's global
    position (see the module docstring). Any other attribute is the dataset's."""

    def __init__(self, dataset: Any, seed: int) -> None:
        self.dataset = dataset
        self.seed = int(seed)

    def __getitem__(self, key: Any) -> Any:
        position = getattr(key, "position", None)
        if position is None:  # a plain index: not from a keyed sampler
            return self.dataset[key]
        from elastic.rng import derive_seed

        if torch.utils.data.get_worker_info() is not None:
            # A loader worker's global streams serve this dataset only, and are reseeded
            # for every sample: nothing to give back, and saving numpy's state and
            # restoring it would cost ~0.1 ms a sample, more than the seeding.
            seed_draws(derive_seed(self.seed, position, SAMPLE_STREAM))
            return self.dataset[int(key)]
        with seeded_draws(derive_seed(self.seed, position, SAMPLE_STREAM)):
            return self.dataset[int(key)]

    def __len__(self) -> int:
        return len(self.dataset)

    def __getattr__(self, name: str) -> Any:
        # "dataset" before it is set (unpickling): no recursion. Dunders (a batched
        # ``__getitems__``, which DataLoader's fetcher prefers) would bypass the seeding.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def __repr__(self) -> str:
        return f"SeededDataset({self.dataset!r})"


def note_loader(loader: Any) -> None:
    """A ``DataLoader`` starts worker processes: when it takes its indices from an
    ``ElasticSampler`` but its dataset is not seeded per sample, tell the sampler (which
    says so at WARNING at its first save). Never raises."""
    try:
        if getattr(loader, "num_workers", 0) <= 0 or isinstance(loader.dataset, SeededDataset):
            return
        for source in (loader.sampler, getattr(loader.batch_sampler, "sampler", None)):
            note = getattr(source, "note_unseeded_workers", None)
            if callable(note):
                note(loader.num_workers)
                return
    except Exception:  # a diagnostic: never stop a loader
        return
