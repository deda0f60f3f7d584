"""A tiny ``LlamaForCausalLM`` trained by ``transformers.Trainer`` with this project's checkpoints.

    torchrun --standalone --nproc_per_node=2 --max_restarts=3 examples/hf_trainer_fit.py \\
        --ckpt-dir /tmp/hf_ckpt --max-steps 20

The adoption is the ``[ckpt]`` lines: an elastic sampler for the data position, the
callback attached to the Trainer, and ``save_strategy="no"`` (the Trainer's own
checkpoints off). Kill a rank (``--fault kill:step=9:rank=1``) or relaunch on another
number of ranks: ``trainer.train()`` resumes where the last checkpoint left it.
``python -m ckpt export CKPT_DIR OUT`` writes a directory ``from_pretrained`` loads.
Rank 0 appends ``{"step", "loss", "world_size", "restart_count"}`` per step to
``--run-dir``/metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import elastic
from integrations.hf_trainer import ElasticCheckpoints

VOCAB = 64


class Tokens(Dataset):
    """``n`` sequences of ``length`` tokens; item ``i`` is a function of ``i``."""

    def __init__(self, n: int, length: int = 16) -> None:
        self.n, self.length = n, length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(1000 + int(i))
        ids = torch.randint(1, VOCAB, (self.length,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}


def collate(items: list[dict]) -> dict:
    return {key: torch.stack([it[key] for it in items]) for key in items[0]}


class Metrics(TrainerCallback):
    """Rank 0's loss per step (the Trainer logs its mean over ranks) into metrics.jsonl."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            row = {"step": state.global_step, "loss": logs["loss"],
                   "world_size": args.world_size,
                   "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))}  # fmt: skip
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt-dir", required=True, help="checkpoint root (path or URL)")
    parser.add_argument("--run-dir", default=None, help="where metrics.jsonl goes")
    parser.add_argument("--max-steps", type=int, default=20)
    parser.add_argument("--ckpt-every", type=int, default=4)
    parser.add_argument("--global-batch", type=int, default=8)
    parser.add_argument("--fault", action="append", default=[], help="elastic fault spec")
    args = parser.parse_args(argv)

    world = int(os.environ.get("WORLD_SIZE", "1"))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True,
    ))  # fmt: skip
    dataset = Tokens(120)
    out = args.run_dir or os.path.join(args.ckpt_dir, "..", "hf_output")
    training = TrainingArguments(
        output_dir=out, max_steps=args.max_steps, learning_rate=3e-3, warmup_steps=3,
        lr_scheduler_type="cosine", per_device_train_batch_size=args.global_batch // world,
        logging_steps=1, report_to="none", use_cpu=True, ddp_backend="gloo" if world > 1 else None,
        save_strategy="no",  # [ckpt] the callback's checkpoints replace the Trainer's
        disable_tqdm=True, seed=0,
    )  # fmt: skip
    callbacks = [Metrics(os.path.join(args.run_dir, "metrics.jsonl"))] if args.run_dir else []
    if args.run_dir:
        os.makedirs(args.run_dir, exist_ok=True)
    trainer = Trainer(model=model, args=training, callbacks=callbacks)
    sampler = elastic.ElasticSampler(len(dataset), args.global_batch, seed=0)  # [ckpt]
    ElasticCheckpoints(  # [ckpt]
        args.ckpt_dir, sampler=sampler, every=args.ckpt_every, faults=args.fault
    ).attach(trainer, sampler.epoch_loader(dataset, collate_fn=collate))
    trainer.train()  # [ckpt] resumes by itself
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
