"""A tiny transformers Llama, FSDP2 on gloo, trained a few steps, checkpointed: for the export e2e.

Run under torchrun (``--nproc_per_node=2``). Uses only the public ``ckpt`` API. At the end,
rank 0 writes into ``--out-dir``:

- ``config.json``: the model's config (``from_pretrained`` needs it next to the weights);
- ``full_state.pt``: ``get_model_state_dict(model, full_state_dict=True)`` of the trained model;
- ``logits.pt``: ``{"input_ids", "logits"}`` of a plain (unsharded) copy of the model loaded
  with that full state, the reference an exported model must reproduce.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import ckpt

VOCAB = 128
SEQ = 16


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2 * SEQ,
        tie_word_embeddings=False,
    )


def reference_input() -> torch.Tensor:
    return torch.arange(2 * SEQ).reshape(2, SEQ) * 7 % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    config = tiny_config()
    torch.manual_seed(0)  # same random init on every rank before sharding
    model = LlamaForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    manager = ckpt.CheckpointManager(args.ckpt_dir, {"model": model, "optim": optim})
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    for _ in range(args.steps):
        ids = torch.randint(0, VOCAB, (2, SEQ), generator=data)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optim.step()
        optim.zero_grad()
    manager.save(args.steps)
    manager.close()

    full = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        config.to_json_file(os.path.join(args.out_dir, "config.json"))
        torch.save(full, os.path.join(args.out_dir, "full_state.pt"))
        plain = LlamaForCausalLM(config)
        plain.load_state_dict(full)
        plain.eval()
        with torch.no_grad():
            logits = plain(input_ids=reference_input()).logits
        torch.save(
            {"input_ids": reference_input(), "logits": logits},
            os.path.join(args.out_dir, "logits.pt"),
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
