"""``python -m ckpt import``: a stock DCP checkpoint becomes a committed one of ours.

torchtitan and plain ``dcp.save`` write ``.metadata`` + ``__<rank>_<n>.distcp`` with no
manifest, checksums or COMPLETE; a resume never uses such a directory. The import reads it
once, as data, and saves it with ``ckpt.save``: verified, resumable on any world size.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle

import pytest
import torch

import ckpt
import ckpt.cli
from testing.spawn import run_ranks

pytestmark = pytest.mark.timeout(300)


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = ckpt.cli.main(list(argv))
    return code, out.getvalue()


def _build(seed: int):
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(10, 22), nn.ReLU(), nn.Linear(22, 5))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _full(model, optim) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True))
    out = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for name, state in osd["state"].items():
        out.update({f"optim.{name}.{k}": v.clone() for k, v in state.items()})
    return out


def stock_save_worker(rank: int, world_size: int, source: str) -> dict:
    """What torchtitan does: FSDP2 model + AdamW, sharded state dicts, stock dcp.save."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optim = _build(seed=5)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        model(torch.randn(4, 10, generator=gen)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optimizer": osd, "train_state": {"step": 30}}, checkpoint_id=source)
    return _full(model, optim)


def resume_worker(rank: int, world_size: int, root: str) -> tuple[int, int, dict]:
    model, optim = _build(seed=99)  # other values: what the resume gives back is the import's
    state = {"model": model, "optim": optim, "train_state": {"step": 0}}
    with ckpt.CheckpointManager(root, state) as manager:
        step = manager.resume(must=True)
    return step, state["train_state"]["step"], _full(model, optim)


def test_a_stock_fsdp_checkpoint_imports_and_resumes_bitwise_on_other_world_sizes(tmp_path):
    source = str(tmp_path / "outputs" / "step-30")
    saved = run_ranks(stock_save_worker, 2, source, timeout_s=120)
    assert all(o.exitcode == 0 for o in saved), [o.error for o in saved]
    before = {n: os.path.getsize(os.path.join(source, n)) for n in os.listdir(source)}
    root = str(tmp_path / "ours")

    code, out = _cli("import", source, root, "--rename", "optimizer=optim")
    assert code == 0, out
    assert "as step 30" in out and "(verified)" in out, out
    assert {n: os.path.getsize(os.path.join(source, n)) for n in os.listdir(source)} == before
    code, out = _cli("verify", root, "--deep")
    assert code == 0 and out.startswith("OK"), out

    expected = saved[0].result
    for world in (3, 1):  # saved on 2 ranks: resharded either way
        outcomes = run_ranks(resume_worker, world, root, timeout_s=120)
        assert all(o.exitcode == 0 for o in outcomes), [o.error for o in outcomes]
        step, train_step, got = outcomes[0].result
        assert (step, train_step) == (30, 30)
        assert got.keys() == expected.keys()
        assert all(torch.equal(got[k], expected[k]) for k in expected), world


class _Gadget:
    """A value whose unpickling would run a command: never run by an import."""

    def __init__(self, canary: str) -> None:
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {self.canary}",))


def _stock(path, **extra) -> str:
    import torch.distributed.checkpoint as dcp

    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "step": 7, **extra}
    dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


def _rewrite_metadata(source: str, change) -> None:
    with open(os.path.join(source, ".metadata"), "rb") as f:
        md = pickle.loads(f.read())  # written by this test
    change(md)
    with open(os.path.join(source, ".metadata"), "wb") as f:
        f.write(pickle.dumps(md))


def test_a_value_that_is_not_plain_data_is_left_out_and_named_never_run(tmp_path):
    canary = str(tmp_path / "CANARY")
    source = _stock(tmp_path / "step-7", note=_Gadget(canary))
    root = str(tmp_path / "ours")
    code, out = _cli("import", source, root)
    assert code == 0, out
    assert not os.path.exists(canary)
    assert "left out     note: not plain data" in out, out
    state = {"model": {"w": torch.zeros(2, 3)}, "step": -1}
    assert ckpt.load(state, root).step == 7
    assert state["step"] == 7 and torch.equal(state["model"]["w"], torch.arange(6.0).reshape(2, 3))


def test_what_cannot_be_imported_is_refused_with_the_reason_and_nothing_committed(tmp_path):
    root = str(tmp_path / "ours")

    def refused(source: str, *extra: str) -> str:
        code, out = _cli("import", source, root, *extra)
        assert code == 2, out
        if os.path.isdir(root):
            assert not ckpt.list_checkpoints(root)
        return out

    (tmp_path / "empty-3").mkdir()
    assert "not a stock DCP checkpoint" in refused(str(tmp_path / "empty-3"))
    assert "nothing is there" in refused(str(tmp_path / "no-such-dir"))
    (tmp_path / "other" / "sub").mkdir(parents=True)
    (tmp_path / "other" / "sub" / "x.bin").write_bytes(b"x")
    assert "nor a save_pretrained directory" in refused(str(tmp_path / "other"))
    assert "give the step with --step" in refused(_stock(tmp_path / "latest"))

    # A 1 KB checkpoint that declares a 4 GiB tensor never allocates it.
    big = _stock(tmp_path / "step-1")

    def huge(md):
        md.state_dict_metadata["model.w"].size = torch.Size([1 << 20, 1 << 10])

    _rewrite_metadata(big, huge)
    assert "more than the" in refused(big)

    # An item outside the directory.
    out_of = _stock(tmp_path / "step-2")

    def escape(md):
        for info in md.storage_data.values():
            info.relative_path = "../step-1/__0_0.distcp"

    _rewrite_metadata(out_of, escape)
    assert "not a shard file" in refused(out_of)

    # A shard that is a symbolic link.
    linked = _stock(tmp_path / "step-3")
    os.rename(os.path.join(linked, "__0_0.distcp"), str(tmp_path / "elsewhere.distcp"))
    os.symlink(str(tmp_path / "elsewhere.distcp"), os.path.join(linked, "__0_0.distcp"))
    assert "not a regular file" in refused(linked)

    code, out = _cli("import", _stock(tmp_path / "step-4"), root, "--rename", "nope")
    assert code == 2 and "OLD=NEW" in out, out


def test_a_model_saved_flat_at_the_top_level_is_put_under_its_key(tmp_path):
    # torchtitan's layout: the model's tensors at the top level, beside train_state.
    import torch.distributed.checkpoint as dcp

    model = torch.nn.Linear(3, 2)
    source = str(tmp_path / "step-12")
    dcp.save(
        {**model.state_dict(), "train_state": {"step": 12}}, checkpoint_id=source, no_dist=True
    )
    root = str(tmp_path / "ours")
    code, out = _cli("import", source, root, "--model-key", "model")
    assert code == 0, out
    fresh = torch.nn.Linear(3, 2)
    state = {"model": fresh, "train_state": {"step": 0}}
    with ckpt.CheckpointManager(root, state) as manager:
        assert manager.resume(must=True) == 12
    assert torch.equal(fresh.weight, model.weight) and state["train_state"]["step"] == 12
    code, out = _cli("import", source, str(tmp_path / "again"), "--model-key", "train_state")
    assert code == 2 and "already has that key" in out, out
