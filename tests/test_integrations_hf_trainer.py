"""``integrations.hf_trainer.ElasticCheckpoints`` in one process (the torchrun kill, the
2 -> 1 resume and the export are in tests/e2e/test_hf_trainer_e2e.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import elastic
from integrations.hf_trainer import ElasticCheckpoints
from testing.local_cluster import REPO

SCRIPT = os.path.join(REPO, "examples", "hf_trainer_fit.py")


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(1, 64, (8,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids.clone()}


def collate(items):
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def trainer(tmp_path, dataset=None, **args) -> Trainer:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16))  # fmt: skip
    settings = dict(output_dir=str(tmp_path / "out"), max_steps=3, report_to="none",
                    use_cpu=True, disable_tqdm=True, per_device_train_batch_size=4)  # fmt: skip
    settings.update(args)
    return Trainer(model=model, args=TrainingArguments(**settings), train_dataset=dataset)


def run(tmp_path, root, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, SCRIPT, "--ckpt-dir", str(root), "--max-steps", "12", *args]
    return subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=240)


def losses(run_dir) -> dict[int, float]:
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as fh:
        return {r["step"]: r["loss"] for r in map(json.loads, fh)}


@pytest.mark.timeout(300)
def test_a_sigterm_commits_an_emergency_checkpoint_and_a_rerun_continues_bitwise(tmp_path):
    """SIGTERM before step 7: step 6 (not a periodic step) is committed and the process
    exits 143; the next run resumes it and every loss equals an uninterrupted run's (step
    6's loss is not logged: the Trainer logs after on_step_end, where the run ended)."""
    whole = run(tmp_path, tmp_path / "whole", "--run-dir", str(tmp_path / "whole_run"))
    assert whole.returncode == 0, whole.stderr[-3000:]
    first = run(tmp_path, tmp_path / "root", "--run-dir", str(tmp_path / "run"),
                "--fault", "sigterm:step=7")  # fmt: skip
    said = first.stdout + first.stderr
    assert first.returncode == 143, said[-3000:]
    assert "emergency checkpoint committed at step 6" in said
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [
        "checkpoint_0000004", "checkpoint_0000006"]  # fmt: skip  (the lease released)
    second = run(tmp_path, tmp_path / "root", "--run-dir", str(tmp_path / "run"))
    assert second.returncode == 0 and "resumed step 6 from" in second.stderr, second.stderr[-3000:]
    reference = losses(tmp_path / "whole_run")
    assert sorted(reference) == list(range(1, 13))
    assert losses(tmp_path / "run") == {s: v for s, v in reference.items() if s != 6}


@pytest.mark.timeout(120)
def test_the_trainers_own_checkpoints_left_on_are_said_at_warning(tmp_path, caplog):
    sampler = elastic.ElasticSampler(len(Tokens()), 4, seed=0, rank=0, world_size=1)
    hf = trainer(tmp_path, save_strategy="steps", save_steps=100)
    ElasticCheckpoints(str(tmp_path / "root"), sampler=sampler, every=2).attach(
        hf, sampler.epoch_loader(Tokens(), collate_fn=collate)
    )
    with caplog.at_level(logging.WARNING, logger="integrations.hf_trainer"):
        hf.train()
    said = [r.getMessage() for r in caplog.records if r.name == "integrations.hf_trainer"]
    assert len(said) == 1 and "save_strategy=" in said[0] and "save_strategy='no'" in said[0]
    assert sorted(p.name for p in (tmp_path / "root").iterdir()) == [
        "checkpoint_0000002", "checkpoint_0000003"]  # fmt: skip


@pytest.mark.timeout(120)
def test_mistakes_in_the_adoption_are_named(tmp_path):
    sampler = elastic.ElasticSampler(len(Tokens()), 4, seed=0, rank=0, world_size=1)
    other = elastic.ElasticSampler(len(Tokens()), 4, seed=1, rank=0, world_size=1)
    with pytest.raises(TypeError, match=r"sampler must be an elastic\.ElasticSampler"):
        ElasticCheckpoints(str(tmp_path), sampler=torch.utils.data.SequentialSampler(range(3)))
    callback = ElasticCheckpoints(str(tmp_path / "root"), sampler=sampler)
    with pytest.raises(ValueError, match="is not this callback's sampler's epoch loader"):
        callback.attach(trainer(tmp_path), other.epoch_loader(Tokens(), collate_fn=collate))
    hf = trainer(tmp_path, dataset=Tokens(), save_strategy="no")
    hf.add_callback(callback)  # given to the Trainer with its own dataset, never attached
    with pytest.raises(RuntimeError, match=r"call callback.attach\(trainer, loader\)"):
        hf.train()
    assert not (tmp_path / "root").exists()
