"""Zero-copy decoding of torch.save'd tensor items (ckpt.format.tensorblob) and its use by load."""

from __future__ import annotations

import io

import pytest
import torch

import ckpt
from ckpt.format.tensorblob import data_layout, view_tensor
from ckpt.loading import reader as reader_mod


def saved(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


CASES = {
    "fp32": lambda: torch.randn(5, 7),
    "transposed": lambda: torch.randn(5, 7).t(),
    "offset_view": lambda: torch.arange(10)[2:7],
    "strided_2d": lambda: torch.randn(4, 4)[::2, 1:],
    "scalar": lambda: torch.tensor(3.5),
    "empty": lambda: torch.empty(0, 4),
    "bf16": lambda: torch.randn(3, 4).to(torch.bfloat16),
    "fp16": lambda: torch.randn(2, 3, dtype=torch.float16),
    "bool": lambda: torch.rand(6) > 0.5,
    "int64": lambda: torch.randint(0, 100, (4, 4)),
    "large": lambda: torch.randn(1 << 18),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_view_equals_torch_load(name):
    torch.manual_seed(0)
    raw = saved(CASES[name]())
    expected = torch.load(io.BytesIO(raw), weights_only=True)
    for buf in (raw, memoryview(b"pad" + raw + b"tail")[3 : 3 + len(raw)]):
        got = view_tensor(buf)
        assert got is not None
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert got.stride() == expected.stride()
        assert torch.equal(got, expected)


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not a zip at all",
        saved({"a": 1}),
        saved([torch.ones(2), torch.zeros(2)]),
        saved(torch.nn.Parameter(torch.ones(2))),
    ],
    ids=["empty", "garbage", "dict", "list", "parameter"],
)
def test_anything_but_a_plain_tensor_is_left_to_torch_load(raw):
    assert view_tensor(raw) is None


@pytest.mark.parametrize("name", ["fp32", "scalar", "bf16", "bool"])
def test_data_layout_of_a_dense_tensor_is_where_its_bytes_are(name):
    tensor = CASES[name]()
    raw = saved(tensor)
    start, size, dtype, shape = data_layout(raw)
    assert (size, dtype, shape) == (
        tensor.numel() * tensor.element_size(),
        str(tensor.dtype),
        tuple(tensor.shape),
    )
    assert (
        raw[start : start + size]
        == tensor.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
    )


@pytest.mark.parametrize("name", ["transposed", "offset_view", "strided_2d", "empty"])
def test_data_layout_refuses_what_is_not_a_dense_row_major_tensor(name):
    # Its stored bytes are not the destination's memory as is: a receiver must not
    # put them into a tensor directly.
    assert data_layout(saved(CASES[name]())) is None


def test_truncated_item_is_not_decoded():
    raw = saved(torch.randn(1000))
    assert view_tensor(raw[: len(raw) // 2]) is None


def test_pickle_globals_outside_the_allowlist_are_refused():
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    assert view_tensor(saved(Evil())) is None


def test_load_uses_views_for_plain_tensors(tmp_path, monkeypatch):
    state = {"w": torch.randn(64, 64), "b": torch.randn(64), "n": 3}
    root = str(tmp_path)
    ckpt.save(state, root, 1)
    loads: list[int] = []
    real_load = torch.load

    def counting_load(*args, **kwargs):
        loads.append(1)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(reader_mod.torch, "load", counting_load)
    target = {"w": torch.zeros(64, 64), "b": torch.zeros(64), "n": 0}
    ckpt.load(target, root)
    assert torch.equal(target["w"], state["w"]) and torch.equal(target["b"], state["b"])
    assert target["n"] == 3
    assert len(loads) == 1  # only the byte item (the int); both tensors were views
