"""An epoch loop as Hugging Face users write it, made fault-tolerant with `ckpt` and `elastic`.

A tiny ``LlamaForCausalLM`` (random init or ``--init-from`` a ``save_pretrained``
directory, tied embeddings) on variable-length token sequences, with a padding collate,
``DataLoader(num_workers=1)``, AdamW and ``get_cosine_schedule_with_warmup``, FSDP2 per
layer, trained for ``--epochs`` epochs with ``for epoch in ...: for batch in loader:``.
``examples/conversions/hf_llama_epochs.patch`` is the change from the plain script; the
lines it adds are marked ``[ft]`` here. What they buy:

- a crash restarted by torchrun resumes from the newest committed checkpoint in the
  epoch it was in, at the batch it was at, bitwise identically on the same world size;
- a resume on another world size continues with the same samples (the loss is divided
  by the step's token count over all ranks and scaled by the world size, which the
  gradient average over ranks takes back, as ``transformers``' Trainer does with
  ``average_tokens_across_devices``: a step's gradient does not depend on the world
  size), and with ``--allow-batch-change`` with another ``--global-batch``, from the
  same sample;
- ``python -m ckpt export CKPT_DIR OUT`` writes a directory ``from_pretrained`` loads
  (config and generation config included, the tied weight once).

Run it on 2 CPU ranks, kill rank 1 at step 7 (in the second epoch), let torchrun restart::

    torchrun --rdzv_backend=ft --rdzv_endpoint=127.0.0.1:0 --nnodes=1 --nproc_per_node=2 \\
        --max_restarts=1 examples/hf_llama_epochs.py --ckpt-dir runs/llama/ckpt \\
        --run-dir runs/llama/run --fault kill:step=7:rank=1

Needs ``transformers`` (``pip install -c constraints.txt -e '.[test]'``).
"""

from __future__ import annotations

import argparse
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

import ckpt
import elastic

logger = logging.getLogger("hf_llama_epochs")
VOCAB, PAD = 64, 0


class ToyTexts(Dataset):
    """``n`` token sequences of 4 to ``max_len`` tokens; item ``i`` is a function of ``i``."""

    def __init__(self, n: int, max_len: int, seed: int) -> None:
        self.n, self.max_len, self.seed = n, max_len, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 100_003 + int(i))
        length = int(torch.randint(4, self.max_len + 1, (1,), generator=g))
        return {"input_ids": torch.randint(1, VOCAB, (length,), generator=g), "idx": int(i)}


def collate(items: list[dict]) -> dict:
    """Pad to the longest sequence; padding is masked out and labelled -100 (HF's convention)."""
    longest = max(len(it["input_ids"]) for it in items)
    input_ids = torch.full((len(items), longest), PAD)
    mask = torch.zeros((len(items), longest), dtype=torch.long)
    for row, it in enumerate(items):
        input_ids[row, : len(it["input_ids"])] = it["input_ids"]
        mask[row, : len(it["input_ids"])] = 1
    labels = input_ids.masked_fill(mask == 0, -100)
    idx = torch.tensor([it["idx"] for it in items])
    return {"input_ids": input_ids, "attention_mask": mask, "labels": labels, "idx": idx}


def model_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, pad_token_id=PAD,
    )  # fmt: skip


def build_model(args: argparse.Namespace) -> LlamaForCausalLM:
    torch.manual_seed(args.seed)
    model = LlamaForCausalLM(model_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--ckpt-dir", required=True, help="checkpoint root")  # [ft]
    add("--run-dir", required=True, help="where metrics.jsonl and events*.jsonl are appended")
    add("--epochs", type=int, default=3, help="epochs to train (default 3)")
    add("--samples", type=int, default=28, help="dataset size (default 28)")
    add("--max-len", type=int, default=12, help="longest sequence in tokens (default 12)")
    add("--global-batch", type=int, default=8, help="sequences per step, all ranks (default 8)")
    add("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    add("--warmup-steps", type=int, default=3, help="warm-up steps (default 3)")
    add("--num-workers", type=int, default=1, help="DataLoader workers (default 1)")
    add("--seed", type=int, default=0, help="init and data order seed (default 0)")
    add("--init-from", help="a save_pretrained directory to start from (default: random init)")
    add("--ckpt-every", type=int, default=2, help="save every N steps (default 2)")  # [ft]
    add("--fault", action="append", default=[], help="e.g. kill:step=7:rank=1")  # [ft]
    add("--allow-batch-change", action="store_true",
        help="resume a checkpoint saved with another --global-batch from its sample cursor")  # [ft]  # fmt: skip
    return parser.parse_args(argv)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ToyTexts(args.samples, args.max_len, args.seed)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = elastic.ElasticSampler(len(dataset), args.global_batch, seed=args.seed,
                                     allow_batch_change=args.allow_batch_change)  # [ft]  # fmt: skip
    loader = sampler.epoch_loader(dataset, collate_fn=collate, num_workers=args.num_workers)  # [ft]
    sched = get_cosine_schedule_with_warmup(opt, args.warmup_steps, args.epochs * len(loader))
    log = elastic.RunRecorder(args.run_dir, rank)
    manager = ckpt.CheckpointManager(args.ckpt_dir, {"model": model, "optim": opt, "sched": sched,
                                     "sampler": sampler}, every=args.ckpt_every, on_event=log.event)  # [ft]  # fmt: skip
    guard = elastic.RunGuard(saver=manager, faults=args.fault, on_event=log.event)  # [ft]
    with log, manager, guard:  # [ft]
        start = manager.resume()  # [ft] newest committed checkpoint, any world size
        if start is None and args.init_from:
            ckpt.load_pretrained(model, args.init_from)  # [ft] each rank reads its shards
        start = start or 0  # [ft]
        for epoch in range(sampler.epoch, args.epochs):  # [ft] a resume goes on in its epoch
            sampler.set_epoch(epoch)
            model.train()
            for step, batch in guard.batches(loader, start):  # [ft] faults, SIGTERM, watchdog
                idx = batch.pop("idx")
                batch = {k: v.to(device) for k, v in batch.items()}
                tokens = (batch["labels"][:, 1:] != -100).sum()
                dist.all_reduce(tokens)  # [ft] the step's tokens on every rank...
                out = model(**batch, num_items_in_batch=tokens)
                (out.loss * world).backward()  # [ft] ...so the gradient is world-size free
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                loss = out.loss.detach().clone()
                dist.all_reduce(loss)
                samples = [None] * world
                dist.all_gather_object(samples, idx.tolist())
                log.metrics({
                    "step": step, "epoch": epoch, "loss": loss.item(), "lr": sched.get_last_lr()[0],
                    "world_size": world, "restart_count": guard.attempt,  # [ft]
                    "samples": [i for part in samples for i in part],
                })  # fmt: skip
                manager.maybe_save(step)  # [ft]
        manager.maybe_save(guard.last_step, final=True)  # [ft] the run ends on a commit
        model.eval()
        with torch.no_grad():
            probe = (torch.arange(2 * 16).reshape(2, 16) * 7 % (VOCAB - 1) + 1).to(device)
            logits = model(input_ids=probe).logits
        if rank == 0:
            torch.save({"input_ids": probe.cpu(), "logits": logits.cpu()},
                       os.path.join(args.run_dir, "final_logits.pt"))  # fmt: skip
        log.event("finished", guard.last_step)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        level=logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING,
    )
    torch.use_deterministic_algorithms(True)
    device = elastic.init_distributed().device  # [ft] torchrun's group, else a 1-rank one
    try:
        train(args, device)
    except elastic.Preempted as exc:  # [ft] SIGTERM: exit 143 after the emergency checkpoint
        return exc.exit_code
    finally:
        elastic.close_distributed()  # [ft]
    return 0


if __name__ == "__main__":
    elastic.exit_now(main())  # [ft] leave without interpreter teardown (gloo threads)
