"""Hugging Face conventions, in and out: tied weights once, the config recorded and exported,
and a ``save_pretrained`` directory loaded into a sharded model on any world size.

Before, tied weights were stored twice (checkpoint and export), an export had no
``config.json`` unless one was given (``from_pretrained`` then failed with a misleading
"should have a `model_type` key"), and nothing loaded an HF directory into a sharded
model. A tiny random-init ``LlamaForCausalLM`` (tied embeddings) is the model throughout.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from transformers import LlamaConfig, LlamaForCausalLM

import ckpt
from ckpt.format import names
from ckpt.interop.pretrained import MAX_HEADER_BYTES
from testing.spawn import run_ok

pytestmark = pytest.mark.timeout(180)


def tiny_config(**overrides) -> LlamaConfig:
    values = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaConfig(**{**values, **overrides})


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides))


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> tuple[str, dict[str, torch.Tensor]]:
    """A save_pretrained directory of a tiny Llama, and its state dict."""
    path = str(tmp_path_factory.mktemp("pretrained") / "llama")
    model = tiny_llama(11)
    model.save_pretrained(path)
    return path, {k: v.clone() for k, v in model.state_dict().items()}


# -- checkpoint: tied weights once, names as DCP's ------------------------------------------


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight


def test_tied_parameters_are_stored_once_and_stay_tied_after_a_resume(tmp_path):
    root = str(tmp_path / "ckpt")
    model = Tied()
    with ckpt.CheckpointManager(root, {"model": model}) as manager:
        manager.maybe_save(1, final=True)
    stored = FileSystemReader(f"{root}/checkpoint_0000001").read_metadata().state_dict_metadata
    assert "model.emb.weight" in stored and "model.head.weight" not in stored
    record = ckpt.find_latest_committed(root).manifest.metadata["ckpt_manager"]
    assert record["tied"] == {"model": {"head.weight": "emb.weight"}}

    again = Tied()
    with ckpt.CheckpointManager(root, {"model": again}) as manager:
        assert manager.resume() == 1
    assert again.head.weight is again.emb.weight
    assert torch.equal(again.emb.weight, model.emb.weight)


def test_names_are_dcps_without_a_wrappers_prefix_and_old_records_map_onto_them():
    inner = torch.nn.Sequential(torch.nn.Linear(2, 3))
    wrapped = torch.compile(inner)  # names its tensors _orig_mod.0.weight
    assert names.canonical_name(wrapped, "_orig_mod.0.weight") == "0.weight"
    assert names.canonical_shapes(wrapped) == {"0.weight": [3, 2], "0.bias": [3]}
    legacy = {"_orig_mod.0.weight": [3, 2], "other.weight": [1]}
    assert names.canonical_record(wrapped, legacy) == {"0.weight": [3, 2], "other.weight": [1]}
    assert names.tied_aliases(Tied()) == {"head.weight": "emb.weight"}


# -- export: the recorded config, generation config, dtype --------------------------------


@pytest.fixture(scope="module")
def llama_root(tmp_path_factory) -> tuple[str, LlamaForCausalLM]:
    root = str(tmp_path_factory.mktemp("llama_ckpt") / "ckpt")
    model = tiny_llama(3)
    with ckpt.CheckpointManager(root, {"model": model}) as manager:
        manager.maybe_save(1, final=True)
    return root, model


def test_a_transformers_model_exports_its_recorded_config_and_loads_with_from_pretrained(
    llama_root, tmp_path
):
    root, model = llama_root
    out = str(tmp_path / "out")
    result = ckpt.export(root, out)
    assert sorted(result.files) == ["config.json", "generation_config.json", "model.safetensors"]
    with open(os.path.join(out, "config.json"), encoding="utf-8") as fh:
        config = json.load(fh)
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    loaded = LlamaForCausalLM.from_pretrained(out)
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_a_cast_export_names_its_dtype_and_an_explicit_config_wins(llama_root, tmp_path):
    root, _ = llama_root
    out = str(tmp_path / "bf16")
    ckpt.export(root, out, dtype="bf16")
    with open(os.path.join(out, "config.json"), encoding="utf-8") as fh:
        assert json.load(fh)["dtype"] == "bfloat16"
    assert LlamaForCausalLM.from_pretrained(out, dtype="auto").dtype == torch.bfloat16

    mine = tmp_path / "mine.json"
    mine.write_text(tiny_config().to_json_string())
    given = str(tmp_path / "given")
    result = ckpt.export(root, given, config=str(mine))
    assert (tmp_path / "given" / "config.json").read_text() == mine.read_text()
    assert "generation_config.json" in result.files  # still the recorded one


# -- load_pretrained: a save_pretrained directory into a sharded model --------------------


def _load_sharded(rank: int, world: int, path: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(99)  # other weights: every one must come from the files
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    result = ckpt.load_pretrained(model, path)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"state": {k: v.clone() for k, v in full.items()}, "read": result.bytes_read,
            "tensors": result.tensors, "tied": tied}  # fmt: skip


@pytest.mark.parametrize("world", [2, 3])
def test_a_save_pretrained_directory_fills_an_fsdp2_model_on_any_world_size(pretrained, world):
    path, want = pretrained
    results = run_ok(_load_sharded, world, path, timeout_s=150)
    total = sum(v.numel() * v.element_size() for k, v in want.items() if k != "lm_head.weight")
    for result in results:
        assert result["tied"]
        assert result["tensors"] == len(want) - 1  # lm_head.weight comes with its owner
        for name, value in want.items():
            assert torch.equal(result["state"][name], value), name
    # each rank read its own rows (the norms' 32-element vectors are rows too)
    assert sum(r["read"] for r in results) == total
    assert max(r["read"] for r in results) < total


def test_an_index_of_shards_loads_and_a_cast_is_said(tmp_path, caplog):
    path = str(tmp_path / "sharded")
    source = tiny_llama(5).to(torch.bfloat16)
    source.save_pretrained(path, max_shard_size="20KB")
    assert os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    model = tiny_llama(6)
    with caplog.at_level("WARNING", logger="ckpt.interop.pretrained"):
        result = ckpt.load_pretrained(model, path)
    assert result.cast and "bfloat16 -> float32" in result.cast[0]
    assert "cast to the model's dtype" in caplog.text
    for name, value in source.state_dict().items():
        assert torch.equal(model.state_dict()[name], value.float()), name


def test_missing_and_misshapen_tensors_are_named(pretrained, tmp_path):
    path, _ = pretrained
    wider = tiny_llama(1, intermediate_size=64)
    with pytest.raises(ckpt.StateMismatchError, match=r"mlp\.gate_proj\.weight: \[48, 32\]"):
        ckpt.load_pretrained(wider, path)
    untied = tiny_llama(1, tie_word_embeddings=False)
    with pytest.raises(ckpt.StateMismatchError, match=r"lm_head\.weight"):
        ckpt.load_pretrained(untied, path)
    result = ckpt.load_pretrained(untied, path, strict=False)
    assert result.missing == ["lm_head.weight"]


def test_a_file_that_is_not_safetensors_is_refused_before_reading_it(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes((MAX_HEADER_BYTES + 1).to_bytes(8, "little") + b"{}")
    with pytest.raises(ckpt.CorruptCheckpointError, match="not a safetensors file"):
        ckpt.load_pretrained(Tied(), str(bad))
    (bad / "model.safetensors").write_bytes((20).to_bytes(8, "little") + b'{"emb.weight": 1}   ')
    with pytest.raises(ckpt.CorruptCheckpointError, match="malformed header entry"):
        ckpt.load_pretrained(Tied(), str(bad))
    with pytest.raises(ckpt.CheckpointNotFoundError, match="save_pretrained"):
        ckpt.load_pretrained(Tied(), str(tmp_path))


def test_code_pointing_keys_of_a_recorded_config_are_left_out_of_an_export(caplog):
    import logging

    from ckpt.state.hf import pretrained_files

    record = {"hf": {"model": {"config": {
        "model_type": "llama", "auto_map": {"AutoModel": "evil.Model"},
        "custom_pipelines": {"x": {"impl": "evil.P"}},
    }}}}  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="ckpt"):
        files = pretrained_files(record, "model")
    config = json.loads(files["config.json"])
    assert config == {"model_type": "llama"}
    assert "auto_map" in caplog.text and "trust_remote_code" in caplog.text


# -- stock torch.distributed.checkpoint.load of a tied model we saved -----------------------


def _stock_load_tied(rank: int, world: int, url: str) -> dict:
    """The recipe docs/ckpt.md gives for stock DCP: the tie is stored once, so the other
    name is missing from the checkpoint; allow_partial_load leaves it to the tie."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = tiny_llama(999)  # other weights until the load
    state = {"model": get_model_state_dict(model)}
    try:
        dcp.load(state, checkpoint_id=url)
        strict = "loaded"
    except CheckpointException as exc:  # what a stock reader sees without the recipe
        strict = str(exc)
    dcp.load(state, checkpoint_id=url, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_model_state_dict(model, state["model"])
    with torch.no_grad():
        logits = model(torch.arange(8).unsqueeze(0)).logits
    return {
        "strict": strict,
        "logits": logits,
        "tied": model.lm_head.weight is model.get_input_embeddings().weight,
    }


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [1, 2])
def test_stock_dcp_load_of_a_tied_model_needs_only_allow_partial_load(llama_root, world):
    root, model = llama_root
    url = ckpt.find_latest_committed(root).url
    got = run_ok(_stock_load_tied, world, url) if world > 1 else [_stock_load_tied(0, 1, url)]
    with torch.no_grad():
        expected = model(torch.arange(8).unsqueeze(0)).logits
    for result in got:
        assert "lm_head.weight" in result["strict"], result["strict"]  # why the recipe exists
        assert result["tied"] and torch.equal(result["logits"], expected)


# -- python -m ckpt import: a save_pretrained directory as a committed checkpoint -----------


def _resume_imported(rank: int, world: int, root: str) -> dict:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    model = tiny_llama(99)  # other weights: every one must come from the checkpoint
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    with ckpt.CheckpointManager(root, {"model": model}) as manager:
        step = manager.resume()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    return {"step": step, "state": {k: v.clone() for k, v in full.items()}, "tied": tied}


def test_a_save_pretrained_directory_imports_as_a_checkpoint_a_manager_resumes_sharded(
    pretrained, tmp_path, capsys
):
    from ckpt import cli

    path, want = pretrained
    root = str(tmp_path / "root")
    assert cli.main(["import", path, root, "--step", "7"]) == 0
    out = capsys.readouterr().out
    assert f"imported {len(want) - 1} tensors" in out and "(verified)" in out  # tied: once
    assert [info.step for info in ckpt.list_checkpoints(root)] == [7]
    for result in run_ok(_resume_imported, 2, root, timeout_s=150):
        assert result["step"] == 7 and result["tied"]
        for name, value in want.items():
            assert torch.equal(result["state"][name], value), name
    # an index of shards too, at step 0 by default; --rename has no meaning here
    sharded = str(tmp_path / "sharded")
    tiny_llama(5).save_pretrained(sharded, max_shard_size="20KB")
    assert cli.main(["import", sharded, str(tmp_path / "other")]) == 0
    assert [info.step for info in ckpt.list_checkpoints(str(tmp_path / "other"))] == [0]
    assert cli.main(["import", sharded, str(tmp_path / "x"), "--rename", "a=b"]) == 2
    assert "--rename is for stock DCP" in capsys.readouterr().err


def test_an_import_of_a_forged_safetensors_file_commits_nothing(tmp_path, capsys):
    import json

    from ckpt import cli

    bad = tmp_path / "bad"
    bad.mkdir()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1 << 28], "data_offsets": [0, 1 << 30]}})
    (bad / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode())
    root = str(tmp_path / "root")
    assert cli.main(["import", str(bad), root]) == 2  # 1 GiB declared by a 90-byte file
    assert "ends at byte" in capsys.readouterr().err
    assert not os.path.exists(root)
