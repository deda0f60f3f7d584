"""ckpt.export: a 2-rank FSDP2 checkpoint out as safetensors and torch, checked tensor by tensor.

The reference is what DCP itself calls the full model state:
``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))``, taken by
the ranks right after the save. Bad input (not a checkpoint, a corrupt shard, a missing
model key, an existing OUT, a partial checkpoint, a remote OUT) is refused with a clear
error and leaves nothing behind.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import ckpt
from ckpt.cli import main as cli_main
from ckpt.errors import CheckpointNotFoundError, CorruptCheckpointError
from ckpt.interop.export import (
    SAFETENSORS_INDEX,
    Chunk,
    ExportError,
    TensorPlan,
    export,
    parse_size,
    plan_shards,
    row_blocks,
    shard_names,
)
from ckpt.loading.reader import load_metadata
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(180)

STEP = 3


def _train_and_save(rank: int, world: int, root: str) -> dict[str, torch.Tensor]:
    from torch import nn
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(11, 8),
        nn.Linear(8, 5),  # 5 rows over 2 ranks: uneven shards
        nn.LayerNorm(5),
        nn.Linear(5, 3, bias=False),
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(STEP):
        model(torch.arange(6).reshape(2, 3)).pow(2).mean().backward()
        optim.step()
        optim.zero_grad()
    manager = ckpt.CheckpointManager(root, {"model": model, "optim": optim, "epoch": 1})
    manager.save(STEP)
    manager.close()
    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {name: t.clone() for name, t in full.items()} if rank == 0 else {}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A checkpoint root written by 2 FSDP2 ranks, and the model's full state dict."""
    root = str(tmp_path_factory.mktemp("export") / "ckpt")
    full = run_ok(_train_and_save, 2, root)[0]
    return root, full


def _copy_root(saved_root: str, tmp_path) -> str:
    root = str(tmp_path / "ckpt")
    shutil.copytree(saved_root, root)
    return root


def _leftovers(parent) -> list[str]:
    return sorted(name for name in os.listdir(parent) if ".tmp-" in name)


def _assert_equal_states(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# -- both formats, tensor by tensor ----------------------------------------------------


def test_safetensors_export_equals_the_full_state_dict_tensor_by_tensor(saved, tmp_path):
    root, full = saved
    out = str(tmp_path / "hf")
    result = export(root, out)
    assert result.step == STEP and result.files == ["model.safetensors"]
    assert result.tensors == len(full)
    assert result.bytes == sum(t.numel() * t.element_size() for t in full.values())
    _assert_equal_states(load_file(os.path.join(out, "model.safetensors")), full)
    assert _leftovers(tmp_path) == []


def test_torch_export_is_one_flat_state_dict_equal_to_the_full_state(saved, tmp_path):
    root, full = saved
    out = str(tmp_path / "model.pt")
    result = export(root, out, format="torch")
    assert result.files == ["model.pt"] and os.path.isfile(out)
    _assert_equal_states(torch.load(out, weights_only=True), full)


def test_dtype_cast_is_the_documented_cast_of_the_full_state(saved, tmp_path):
    root, full = saved
    out = str(tmp_path / "bf16")
    result = export(root, out, dtype="bf16")
    assert result.dtypes == ["bfloat16"]
    got = load_file(os.path.join(out, "model.safetensors"))
    _assert_equal_states(got, {name: t.to(torch.bfloat16) for name, t in full.items()})


def test_a_small_max_shard_size_writes_hf_shards_and_an_index(saved, tmp_path):
    root, full = saved
    out = str(tmp_path / "sharded")
    result = export(root, out, max_shard_size=120)
    shards = [f for f in result.files if f.endswith(".safetensors")]
    assert len(shards) >= 3 and shards == shard_names(len(shards))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    with open(os.path.join(out, SAFETENSORS_INDEX)) as handle:
        index = json.load(handle)
    assert index["metadata"]["total_size"] == result.bytes
    assert sorted(index["weight_map"]) == sorted(full)
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = load_file(os.path.join(out, shard))
        assert all(index["weight_map"][name] == shard for name in part)
        # 120 bytes per file, except a tensor larger than that, alone in its file
        assert len(part) == 1 or sum(t.numel() * t.element_size() for t in part.values()) <= 120
        merged.update(part)
    _assert_equal_states(merged, full)


def test_rename_by_dict_and_by_callable_and_none_drops(saved, tmp_path):
    root, full = saved
    table = {"0.weight": "embed.weight", "3.weight": None}
    got = load_file(
        os.path.join(export(root, str(tmp_path / "d"), rename=table).out, "model.safetensors")
    )
    want = {table.get(n, n): t for n, t in full.items() if table.get(n, n) is not None}
    _assert_equal_states(got, want)

    out = export(root, str(tmp_path / "c"), rename=lambda name: f"model.layers.{name}")
    got = load_file(os.path.join(out.out, "model.safetensors"))
    _assert_equal_states(got, {f"model.layers.{n}": t for n, t in full.items()})

    with pytest.raises(ExportError, match="must be unique"):
        export(root, str(tmp_path / "dup"), rename=lambda name: "same")
    assert not os.path.exists(tmp_path / "dup") and _leftovers(tmp_path) == []


def test_a_rename_entry_that_matches_no_tensor_is_said_at_warning(saved, tmp_path, caplog):
    root, full = saved
    table = {"0.weight": "embed.weight", "0.wieght": "typo", "9.bias": "gone"}
    with caplog.at_level(logging.WARNING, logger="ckpt.interop.export"):
        out = export(root, str(tmp_path / "t"), rename=table)
    said = [r.getMessage() for r in caplog.records if "rename entr" in r.getMessage()]
    assert len(said) == 1 and "2 rename entries" in said[0]
    assert "'0.wieght'" in said[0] and "'9.bias'" in said[0] and "'0.weight'" not in said[0]
    got = load_file(os.path.join(out.out, "model.safetensors"))
    _assert_equal_states(got, {table.get(n, n): t for n, t in full.items()})

    caplog.clear()  # every entry matches, or a callable: nothing said
    with caplog.at_level(logging.WARNING, logger="ckpt.interop.export"):
        export(root, str(tmp_path / "ok"), rename={"0.weight": "embed.weight"})
        export(root, str(tmp_path / "fn"), rename=lambda name: name)
    assert not [r for r in caplog.records if "rename entr" in r.getMessage()]


def test_cli_exports_with_a_json_rename_table_and_a_config(saved, tmp_path, capsys):
    root, full = saved
    table = tmp_path / "rename.json"
    table.write_text(json.dumps({"1.bias": "proj.bias"}))
    config = tmp_path / "my_config.json"
    config.write_text('{"model_type": "toy"}')
    out = str(tmp_path / "cli")
    code = cli_main(
        ["export", root, out, "--rename", str(table), "--config", str(config), "--dtype", "fp16"]
    )
    assert code == 0
    printed = capsys.readouterr().out
    assert f"tensors {len(full)}" in printed and "float16" in printed
    assert "model.safetensors" in printed
    assert json.loads((tmp_path / "cli" / "config.json").read_text()) == {"model_type": "toy"}
    got = load_file(os.path.join(out, "model.safetensors"))
    assert "proj.bias" in got and "1.bias" not in got
    assert torch.equal(got["proj.bias"], full["1.bias"].half())


def test_export_reads_a_gcs_checkpoint(saved, tmp_path, gcs_root):
    from testing.gcs_emulator import gcs_filesystem

    root, full = saved
    dirname = f"checkpoint_{STEP:07d}"
    gcs_filesystem().put(
        os.path.join(root, dirname), f"{gcs_root.removeprefix('gs://')}/{dirname}", recursive=True
    )
    out = str(tmp_path / "from_gcs")
    result = export(gcs_root, out)
    assert result.checkpoint_url == f"{gcs_root}/{dirname}"
    _assert_equal_states(load_file(os.path.join(out, "model.safetensors")), full)


# -- bad input: a clear error, nothing written ----------------------------------------


def test_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointNotFoundError, match="no committed checkpoint"):
        export(str(tmp_path / "empty"), str(tmp_path / "out"))
    assert cli_main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 1
    assert not os.path.exists(tmp_path / "out") and _leftovers(tmp_path) == []


def _flip_a_byte_of(root: str, fqn: str) -> str:
    ckpt_dir = os.path.join(root, f"checkpoint_{STEP:07d}")
    with open(os.path.join(ckpt_dir, ".metadata"), "rb") as handle:
        metadata = load_metadata(handle.read())
    _, info = next((i, s) for i, s in metadata.storage_data.items() if i.fqn == fqn)
    path = os.path.join(ckpt_dir, info.relative_path)
    with open(path, "r+b") as handle:
        handle.seek(info.offset + info.length - 100)  # inside the tensor's data
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0xFF]))
    return info.relative_path


def test_a_corrupt_shard_is_a_clear_error_and_leaves_nothing(saved, tmp_path):
    root = _copy_root(saved[0], tmp_path)
    # the last model tensor: the output directory exists by the time it is read
    shard = _flip_a_byte_of(root, "model.3.weight")
    out = tmp_path / "out"
    with pytest.raises(CorruptCheckpointError, match=rf"{shard}.*crc32c.*corrupt"):
        export(root, str(out))
    assert not out.exists() and _leftovers(tmp_path) == []
    assert cli_main(["export", root, str(out), "--format", "torch"]) == 2
    assert not out.exists() and _leftovers(tmp_path) == []


def test_a_corrupt_optimizer_shard_does_not_stop_a_model_export(saved, tmp_path):
    root = _copy_root(saved[0], tmp_path)
    _flip_a_byte_of(root, "optim.state.1.weight.exp_avg")
    _assert_equal_states(
        load_file(os.path.join(export(root, str(tmp_path / "out")).out, "model.safetensors")),
        saved[1],
    )


def test_a_missing_model_key_names_the_keys_there_are(saved, tmp_path):
    with pytest.raises(ExportError, match=r"'net'.*model, optim.*--model-key"):
        export(saved[0], str(tmp_path / "out"), model_key="net")
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_an_existing_out_is_refused_and_kept(saved, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(ExportError, match="already exists"):
        export(saved[0], str(out))
    assert os.listdir(out) == ["mine.txt"] and _leftovers(tmp_path) == []


def test_partial_and_quarantined_checkpoints_are_refused(saved, tmp_path):
    root = _copy_root(saved[0], tmp_path)
    dirname = f"checkpoint_{STEP:07d}"
    os.remove(os.path.join(root, dirname, "COMPLETE"))
    with pytest.raises(ExportError, match="partial, not committed"):
        export(root, str(tmp_path / "out"), step=STEP)
    aside = os.path.join(root, f"{dirname}.quarantined-20261124T000000000Z")
    os.rename(os.path.join(root, dirname), aside)
    with pytest.raises(ExportError, match="quarantined"):
        export(aside, str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and _leftovers(tmp_path) == []


def test_a_remote_out_is_refused_before_anything_is_read(saved):
    with pytest.raises(ExportError, match=r"local path.*copy it"):
        export(saved[0], "gs://bucket/model")


# -- pure planning ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 << 30), ("1.5KB", 1500), (64, 64)],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "5 parsecs", "-1", "0"])
def test_parse_size_refuses_nonsense(text):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(text)


def _plan(name: str, numel: int) -> TensorPlan:
    return TensorPlan(
        key=f"model.{name}",
        name=name,
        shape=(numel,),
        stored_dtype=torch.float32,
        dtype=torch.float32,
        chunks=[],
    )


@pytest.mark.parametrize(
    ("numels", "limit", "expected"),
    [
        ([1, 1, 1], 8, [["a", "b"], ["c"]]),  # 4 bytes each, 8 per file
        ([3], 4, [["a"]]),  # larger than the limit: alone
        ([1, 5, 1], 8, [["a"], ["b"], ["c"]]),
        ([1, 1], 100, [["a", "b"]]),
    ],
)
def test_plan_shards(numels, limit, expected):
    tensors = [_plan(name, n) for name, n in zip("abc", numels)]
    assert [[t.name for t in shard] for shard in plan_shards(tensors, limit)] == expected


def _chunked(shape: tuple[int, ...], blocks: list[tuple[tuple[int, ...], tuple[int, ...]]]):
    chunks = [
        Chunk(offsets=o, sizes=s, path="rank_00000.distcp", offset=i, length=1)
        for i, (o, s) in enumerate(blocks)
    ]
    return TensorPlan(
        key="model.w",
        name="w",
        shape=shape,
        stored_dtype=torch.float32,
        dtype=torch.float32,
        chunks=chunks,
    )


@pytest.mark.parametrize(
    ("shape", "blocks", "streamed"),
    [
        ((4, 3), [((2, 0), (2, 3)), ((0, 0), (2, 3))], [0, 2]),  # row blocks, out of order
        ((4, 3), [((0, 0), (4, 3))], [0]),
        ((), [((), ())], [0]),  # a scalar
        ((4, 3), [((0, 0), (4, 2)), ((0, 2), (4, 1))], None),  # column shards: assembled
        ((4, 3), [((0, 0), (2, 3)), ((3, 0), (1, 3))], None),  # a gap
    ],
)
def test_row_blocks_stream_only_whole_rows_in_order(shape, blocks, streamed):
    got = row_blocks(_chunked(shape, blocks))
    assert (None if got is None else [c.offsets[0] if c.offsets else 0 for c in got]) == streamed


def test_progress_lines_go_to_the_given_stream(saved, tmp_path, monkeypatch):
    import importlib
    import io

    module = importlib.import_module("ckpt.interop.export")  # ckpt.export is the function
    monkeypatch.setattr(module, "PROGRESS_EVERY_S", 0.0)
    stream = io.StringIO()
    result = export(saved[0], str(tmp_path / "out"), progress=stream)
    lines = stream.getvalue().splitlines()
    assert len(lines) == result.tensors
    assert lines[-1].startswith(f"export: {result.tensors}/{result.tensors} tensors")
