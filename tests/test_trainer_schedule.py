"""LR schedule: linear warmup, cosine decay, floor; a pure function of the step."""

from __future__ import annotations

import itertools
import math

import pytest

from trainer.config import OptimConfig
from trainer.schedule import lr_at

pytestmark = pytest.mark.timeout(30)

CFG = OptimConfig(lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (1, 0.1),
        (5, 0.5),
        (10, 1.0),
        (60, 0.1 + 0.5 * (1 + math.cos(math.pi * 0.5)) * 0.9),
        (110, 0.1),
        (1000, 0.1),
    ],
)
def test_lr_table(step, expected):
    assert lr_at(step, CFG) == pytest.approx(expected)


def test_monotone_after_warmup():
    lrs = [lr_at(s, CFG) for s in range(10, 120)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))


def test_no_warmup_starts_at_peak():
    cfg = OptimConfig(lr=0.5, min_lr=0.0, warmup_steps=0, decay_steps=100)
    assert lr_at(1, cfg) == pytest.approx(0.5 * 0.5 * (1 + math.cos(math.pi / 100)))


def test_step_zero_rejected():
    with pytest.raises(ValueError, match="step must be >= 1"):
        lr_at(0, CFG)
