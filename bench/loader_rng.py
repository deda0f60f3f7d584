"""loader_resume_exact and loader_seed_overhead: random augmentation drawn in DataLoader
workers across a resume, ours (per-sample seeding, :mod:`elastic.sample_seeds`) beside
torchdata's ``StatefulDataLoader`` (it checkpoints the loader, its workers included).

One process, no process group. The dataset is a vision-style one: each ``__getitem__``
takes a random crop of a 3x40x40 image (``torch.randint``), flips it at random
(``random``) and adds noise (``numpy`` and ``torch.rand``). For each case ``(workers
before, workers after, persistent)`` of :data:`CASES`:

- the reference is an uninterrupted pass of :data:`BATCHES` batches with the "before"
  worker count;
- the resumed run stops after :data:`STOP` batches, keeps the loader's state (ours: the
  sampler's ``state_dict``; torchdata: the loader's) and the global RNG states (what a
  checkpoint holds), then a fresh loader with the "after" worker count restores them and
  runs to the end.

A case's value is the fraction of the resumed batches bitwise equal to the reference's
(a refused ``load_state_dict`` is 0 and says why). ``loader_resume_exact`` is ours, the
smallest over the cases; torchdata's cases are in its detail (or why they were not
measured: torchdata is not a dependency). ``loader_seed_overhead``: seconds per batch of
ours with per-sample seeding over the same loader without it (``seed_samples=False``),
medians of :data:`TIMING_ROUNDS` passes of :data:`TIMED_BATCHES` batches with
:data:`TIMED_WORKERS` workers; the same with no workers in its detail (there the caller's
random states are saved and given back around each sample, ~0.1 ms, mostly numpy's).
"""

from __future__ import annotations

import hashlib
import random
import statistics
import time
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from bench.metrics import Metric

SAMPLES = 96
BATCH = 4
BATCHES = SAMPLES // BATCH
STOP = 7
CASES: tuple[tuple[int, int, bool], ...] = (
    (2, 2, False),
    (2, 2, True),
    (2, 1, False),
    (2, 0, False),
    (0, 2, False),
)
TIMING_ROUNDS = 5
TIMED_WORKERS = 2
TIMED_BATCHES = 200
SEED = 7


class Augmented(torch.utils.data.Dataset):
    """Random crop, flip and noise per sample, drawn from torch, random and numpy."""

    def __init__(self) -> None:
        self.images = torch.linspace(0, 1, SAMPLES * 3 * 40 * 40).reshape(SAMPLES, 3, 40, 40)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> torch.Tensor:
        top, left = (int(v) for v in torch.randint(0, 9, (2,)))
        x = self.images[i, :, top : top + 32, left : left + 32]
        if random.random() < 0.5:
            x = torch.flip(x, dims=[2])
        return x + float(np.random.normal()) * 0.01 + torch.rand(x.shape) * 0.01


def _digest(batch: torch.Tensor) -> str:
    return hashlib.sha256(batch.numpy().tobytes()).hexdigest()


def _fresh_process_rng() -> None:
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)


def _rng_states() -> tuple[Any, ...]:
    return torch.get_rng_state(), random.getstate(), np.random.get_state()


def _restore_rng(states: tuple[Any, ...]) -> None:
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


class _Ours:
    """``ElasticSampler(...).loader(dataset)``: the sampler's state is the loader's."""

    name = "ours"

    def __init__(self, workers: int, persistent: bool, state: Any = None) -> None:
        import elastic

        self.sampler = elastic.ElasticSampler(SAMPLES, BATCH, seed=SEED, rank=0, world_size=1)
        if state is not None:
            self.sampler.load_state_dict(state)
        self.loader = self.sampler.loader(
            Augmented(), num_workers=workers, persistent_workers=persistent and workers > 0
        )
        self.it = iter(self.loader)

    def batches(self, n: int) -> list[str]:
        out = []
        for _ in range(n):
            out.append(_digest(next(self.it)))
            self.sampler.advance()
        return out

    def state(self) -> Any:
        return self.sampler.state_dict()


class _Torchdata:
    """``StatefulDataLoader(dataset, shuffle=True, generator=seeded)``."""

    name = "torchdata"

    def __init__(self, workers: int, persistent: bool, state: Any = None) -> None:
        from torchdata.stateful_dataloader import StatefulDataLoader

        self.loader = StatefulDataLoader(
            Augmented(),
            batch_size=BATCH,
            shuffle=True,
            generator=torch.Generator().manual_seed(SEED),
            num_workers=workers,
            persistent_workers=persistent and workers > 0,
        )
        if state is not None:
            self.loader.load_state_dict(state)
        self.it = iter(self.loader)

    def batches(self, n: int) -> list[str]:
        return [_digest(next(self.it)) for _ in range(n)]

    def state(self) -> Any:
        return self.loader.state_dict()


def resumed_fraction(kind: Callable[..., Any], before: int, after: int, persistent: bool) -> float:
    """The fraction of batches after the resume equal to the uninterrupted pass's."""
    _fresh_process_rng()
    reference = kind(before, persistent).batches(BATCHES)
    _fresh_process_rng()
    first = kind(before, persistent)
    first.batches(STOP)
    state, rng = first.state(), _rng_states()
    del first
    _fresh_process_rng()
    _restore_rng(rng)  # what the checkpoint gives the new process
    resumed = kind(after, persistent, state).batches(BATCHES - STOP)
    equal = sum(a == b for a, b in zip(reference[STOP:], resumed, strict=True))
    return equal / (BATCHES - STOP)


def _cases(kind: Callable[..., Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for before, after, persistent in CASES:
        key = f"{before}->{after} workers{' persistent' if persistent else ''}"
        try:
            out[key] = round(resumed_fraction(kind, before, after, persistent), 3)
        except Exception as exc:  # a loader that refuses the state: that is the result
            out[key] = f"refused: {type(exc).__name__}: {str(exc)[:120] or 'no message'}"
    return out


def _seconds_per_batch(seed_samples: bool, workers: int) -> float:
    import elastic

    sampler = elastic.ElasticSampler(SAMPLES, BATCH, seed=SEED, rank=0, world_size=1)
    loader = sampler.loader(Augmented(), seed_samples=seed_samples, num_workers=workers)
    it = iter(loader)
    for _ in range(max(1, 2 * workers)):  # first-use costs, workers started
        next(it)
    t0 = time.perf_counter()
    for _ in range(TIMED_BATCHES):
        next(it)
    return (time.perf_counter() - t0) / TIMED_BATCHES


def _overhead(rounds: int, workers: int) -> tuple[float, dict[str, Any]]:
    seeded: list[float] = []
    plain: list[float] = []
    for i in range(rounds):
        for flag in (True, False) if i % 2 == 0 else (False, True):
            (seeded if flag else plain).append(_seconds_per_batch(flag, workers))
    s, p = statistics.median(seeded), statistics.median(plain)
    return s / p, {
        "seeded_ms_per_batch": round(s * 1e3, 3),
        "plain_ms_per_batch": round(p * 1e3, 3),
    }


def loader_metrics(rounds: int = TIMING_ROUNDS) -> list[Metric]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchdata's deprecation notes
        ours = _cases(_Ours)
        try:
            import torchdata.stateful_dataloader  # noqa: F401

            theirs: dict[str, Any] = _cases(_Torchdata)
        except ImportError:
            theirs = {"status": "not measured: torchdata is not installed (pip install torchdata)"}
    fractions = [v if isinstance(v, float) else 0.0 for v in ours.values()]
    exact = Metric(
        name="loader_resume_exact",
        value=min(fractions),
        detail={
            "ours": ours,
            "torchdata_stateful_dataloader": theirs,
            "batches": BATCHES,
            "stop": STOP,
        },
    )
    ratio, detail = _overhead(rounds, TIMED_WORKERS)
    in_process, detail["no_workers"] = _overhead(rounds, 0)
    detail["no_workers"]["ratio"] = round(in_process, 3)
    overhead = Metric(
        name="loader_seed_overhead",
        value=ratio,
        detail={**detail, "workers": TIMED_WORKERS, "batch": BATCH, "rounds": rounds},
    )
    return [exact, overhead]
