"""examples/hf_llama_epochs.py before it was made fault-tolerant: plain PyTorch and transformers.

The epoch loop as Hugging Face users write it (``DistributedSampler``, ``set_epoch``,
``for batch in loader``), kept to measure what the conversion changes (README, "Bring
your own model"; ``tests/test_adoption_diffs.py``). Runs under torchrun; a crash loses
the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from transformers import LlamaConfig, LlamaForCausalLM, get_cosine_schedule_with_warmup

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
    if args.init_from:
        model = LlamaForCausalLM.from_pretrained(args.init_from)
    else:
        model = LlamaForCausalLM(model_config())
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
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
    return parser.parse_args(argv)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ToyTexts(args.samples, args.max_len, args.seed)
    model = build_model(args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed)
    loader = DataLoader(dataset, batch_size=args.global_batch // world, sampler=sampler,
                        collate_fn=collate, num_workers=args.num_workers)  # fmt: skip
    sched = get_cosine_schedule_with_warmup(opt, args.warmup_steps, args.epochs * len(loader))
    os.makedirs(args.run_dir, exist_ok=True)
    log = open(os.path.join(args.run_dir, "metrics.jsonl"), "a") if rank == 0 else None  # noqa: SIM115
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for batch in loader:
            step += 1
            idx = batch.pop("idx")
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch)
            out.loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            loss = out.loss.detach().clone()
            dist.all_reduce(loss)
            samples = [None] * world
            dist.all_gather_object(samples, idx.tolist())
            if log is not None:
                log.write(json.dumps({
                    "step": step, "epoch": epoch, "loss": loss.item() / world, "lr": sched.get_last_lr()[0],
                    "world_size": world,
                    "samples": [i for part in samples for i in part],
                }) + "\n")  # fmt: skip
    model.eval()
    with torch.no_grad():
        probe = (torch.arange(2 * 16).reshape(2, 16) * 7 % (VOCAB - 1) + 1).to(device)
        logits = model(input_ids=probe).logits
    if rank == 0:
        torch.save({"input_ids": probe.cpu(), "logits": logits.cpu()},
                   os.path.join(args.run_dir, "final_logits.pt"))  # fmt: skip
        log.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s",
    )
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo")
    device = torch.device("cpu")
    try:
        train(args, device)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
