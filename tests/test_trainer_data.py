"""Data: deterministic corpus, global order independent of world size, batch layout."""

from __future__ import annotations

import fsspec
import numpy as np
import pytest

from trainer.config import DataConfig
from trainer.corpus import ALPHABET, CharTokenizer, arithmetic_text
from trainer.data import (
    BatchLayout,
    BatchLayoutError,
    GlobalOrder,
    build_samples,
    micro_batch_ids,
    samples_digest,
)

pytestmark = pytest.mark.timeout(30)


def test_corpus_is_deterministic_and_well_formed():
    a = arithmetic_text(7, 5000)
    assert a == arithmetic_text(7, 5000)
    assert a != arithmetic_text(8, 5000)
    assert len(a) == 5000 and set(a) <= set(ALPHABET)
    for fact in a.replace("\n", "").split(";")[:-1]:
        lhs, rhs = fact.split("=")
        assert eval(lhs) == int(rhs)  # the arithmetic is right, so it is learnable


def test_tokenizer_round_trip_and_foreign_char():
    tok = CharTokenizer()
    assert tok.decode(tok.encode("12+7=19;")) == "12+7=19;"
    with pytest.raises(ValueError, match="'x'"):
        tok.encode("1x")


def test_global_order_is_a_permutation_per_epoch():
    order = GlobalOrder(50, seed=3)
    first, second = order.sample_ids(0, 50), order.sample_ids(50, 50)
    assert sorted(first) == list(range(50)) == sorted(second)
    assert not np.array_equal(first, second)
    assert np.array_equal(
        GlobalOrder(50, seed=3).sample_ids(45, 10), np.concatenate([first[45:], second[:5]])
    )


@pytest.mark.parametrize("micro", [1, 2])
def test_global_sequence_is_independent_of_world_size(micro):
    """Concatenating every rank's micro-batches in rank order gives the same global batch."""
    order = GlobalOrder(37, seed=11)
    global_batch = 12 * micro
    sequences = {}
    for world in (1, 2, 3, 4):
        layout = BatchLayout.plan(global_batch, micro, world)
        cursor, consumed = 0, []
        for _ in range(9):  # crosses epoch boundaries (37 samples)
            for rank in range(world):
                consumed.extend(np.concatenate(micro_batch_ids(order, cursor, layout, rank)))
            cursor += global_batch
        sequences[world] = np.asarray(consumed)
    for world in (2, 3, 4):
        assert np.array_equal(sequences[world], sequences[1])
    assert np.array_equal(sequences[1], order.sample_ids(0, 9 * global_batch))


def test_micro_batches_are_the_same_set_at_any_world_size():
    order = GlobalOrder(100, seed=0)

    def micro_batches(world):
        layout = BatchLayout.plan(12, 2, world)
        return [tuple(m) for r in range(world) for m in micro_batch_ids(order, 24, layout, r)]

    assert micro_batches(1) == micro_batches(2) == micro_batches(3)


@pytest.mark.parametrize(("world", "accum"), [(1, 12), (2, 6), (3, 4), (4, 3)])
def test_batch_layout(world, accum):
    assert BatchLayout.plan(24, 2, world).accum == accum


def test_indivisible_batch_is_a_clear_error():
    with pytest.raises(
        BatchLayoutError,
        match=r"data.global_batch=24 is not divisible by world_size\*data.micro_batch = 5\*2 = 10",
    ):
        BatchLayout.plan(24, 2, 5)


def test_token_file_local_and_url(tmp_path):
    tokens = (np.arange(1000) % 300).astype(np.uint16)
    local = tmp_path / "train.bin"
    tokens.tofile(local)
    url = "memory://test_trainer_data/train.bin"
    with fsspec.open(url, "wb") as fh:
        fh.write(tokens.tobytes())
    for source in (str(local), url):
        samples = build_samples(DataConfig(source=source), seq_len=16, vocab_size=0)
        assert samples.vocab_size == 300
        assert len(samples) == (1000 - 1) // 16
        x, y = samples.get(np.array([2, 0]))
        assert x.shape == (2, 16) and x[0, 0].item() == 32 and y[0, 0].item() == 33
    with pytest.raises(ValueError, match=r"model\.vocab_size=100"):
        build_samples(DataConfig(source=str(local)), seq_len=16, vocab_size=100)
    with pytest.raises(FileNotFoundError, match="token file not found"):
        build_samples(DataConfig(source=str(tmp_path / "missing.bin")), seq_len=16, vocab_size=0)


def test_samples_digest_is_order_sensitive():
    assert samples_digest(np.array([1, 2, 3])) != samples_digest(np.array([3, 2, 1]))
    assert samples_digest(np.array([1, 2, 3])) == samples_digest(np.array([1, 2, 3]))


@pytest.mark.parametrize(("world", "micro"), [(1, 2), (2, 1), (3, 2), (4, 3)])
def test_trainer_sampler_gives_the_layout_ids_and_dropout_keys(world, micro):
    """The trainer takes its micro-batches from ``ElasticSampler.micro_batches``: the same
    sample ids as the batch layout (``micro_batch_ids``) and dropout keyed by
    (step, rank * accum + k), so checkpoints and masks from before the switch carry on."""
    from elastic.sampler import ElasticSampler

    global_batch = 12 * micro
    layout = BatchLayout.plan(global_batch, micro, world)
    order = GlobalOrder(41, seed=5)
    for rank in range(world):
        sampler = ElasticSampler(41, global_batch, seed=5, rank=rank, world_size=world)
        for step in range(1, 6):  # crosses an epoch boundary (41 samples)
            cursor = (step - 1) * global_batch
            assert sampler.cursor == cursor
            local = sampler.local_batch_ids()
            mbs = sampler.micro_batches(micro)
            expected = micro_batch_ids(order, cursor, layout, rank)
            assert len(mbs) == layout.accum == len(expected)
            for k, (mb, ids) in enumerate(zip(mbs, expected, strict=True)):
                assert np.array_equal(local[mb.local], ids)
                assert (mb.step, mb.index) == (step, rank * layout.accum + k)
            sampler.advance()
