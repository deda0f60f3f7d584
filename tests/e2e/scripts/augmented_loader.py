"""A vision-style user script: a random crop, flip and noise drawn in ``Dataset.__getitem__``
(torch, random, numpy), DataLoader workers, a checkpoint every 3 steps.

argv: ROOT OUT MODE WORKERS PERSISTENT STOP. MODE ``epochs``: ``sampler.epoch_loader``
(3 epochs); ``user``: the user's own DataLoader with the one-line hook
(``sampler.seeded(dataset)``); ``plain``: the user's own DataLoader without it. Each step
appends ``[step, batch digest, loss]`` to OUT; STOP > 0 ends the process without cleanup
right after that step (a kill).
"""

import hashlib
import json
import os
import random
import sys

import numpy as np
import torch

import ckpt
import elastic

root, out, mode = sys.argv[1], sys.argv[2], sys.argv[3]
workers, persistent, stop = int(sys.argv[4]), sys.argv[5] == "1", int(sys.argv[6])


class Augmented(torch.utils.data.Dataset):
    def __init__(self):
        self.images = torch.arange(40 * 16, dtype=torch.float32).reshape(40, 1, 4, 4) / 640.0

    def __len__(self):
        return 40

    def __getitem__(self, i):
        x = torch.roll(self.images[i], shifts=int(torch.randint(0, 3, ())), dims=2)  # crop
        if random.random() < 0.5:  # flip
            x = torch.flip(x, dims=[2])
        return x + float(np.random.normal()) * 0.01 + torch.rand(()) * 0.01  # noise


elastic.init_distributed()
torch.manual_seed(0)
model = torch.nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
sampler = elastic.ElasticSampler(40, global_batch=4, seed=7)
dataset = Augmented()
keep = persistent and workers > 0
if mode == "epochs":
    loader = sampler.epoch_loader(dataset, num_workers=workers, persistent_workers=keep)
elif mode == "user":
    loader = torch.utils.data.DataLoader(
        sampler.seeded(dataset), sampler=sampler, batch_size=4, num_workers=workers,
        persistent_workers=keep,
    )  # fmt: skip
else:
    loader = torch.utils.data.DataLoader(dataset, sampler=sampler, batch_size=4, num_workers=workers)
manager = ckpt.CheckpointManager(root, {"model": model, "optim": opt, "sampler": sampler}, every=3)


def train_step(step, batch, log):
    loss = model(batch.reshape(len(batch), -1)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    digest = hashlib.sha256(batch.numpy().tobytes()).hexdigest()[:16]
    log.write(json.dumps([step, digest, loss.item()]) + "\n")
    log.flush()


def maybe_stop(step):
    if step == stop:
        manager.wait()
        os._exit(1)


with open(out, "a") as log, manager, elastic.RunGuard(saver=manager) as guard:
    start = manager.resume() or 0
    if mode == "epochs":
        for epoch in range(sampler.epoch, 3):
            sampler.set_epoch(epoch)
            for step, batch in guard.batches(loader, start):
                train_step(step, batch, log)
                manager.maybe_save(step)
                maybe_stop(step)
    else:
        batches = iter(loader)
        for step in guard.steps(start, 20):
            train_step(step, next(batches), log)
            sampler.advance()
            manager.maybe_save(step, final=step == 20)
            maybe_stop(step)
