"""Process-group setup for torchrun and for a plain single process.

Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) the group
is initialized from the environment. Without them, a 1-rank group is created on a free
loopback port so the same code path (FSDP2, DCP, collectives) runs in one process.
The backend is ``nccl`` when CUDA is available, else ``gloo``.
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

import ckpt
from ckpt.dist import release_groups
from elastic.identity import RunIdentity

logger = logging.getLogger(__name__)


DEFAULT_TIMEOUT = datetime.timedelta(seconds=120)


@dataclass(frozen=True, slots=True)
class DistContext:
    """This process's place in the job and the device it computes on."""

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(
    identity: RunIdentity, timeout: datetime.timedelta = DEFAULT_TIMEOUT
) -> DistContext:
    """Initialize the default process group (all ranks call this once, first).

    With torchrun's variables (``identity.master_addr`` set) the group is built from the
    environment; otherwise this process becomes rank 0 of a 1-rank group on a free port.
    """
    use_cuda = torch.cuda.is_available()
    backend = "nccl" if use_cuda else "gloo"
    if not dist.is_initialized():
        if identity.master_addr is not None:
            dist.init_process_group(backend=backend, timeout=timeout)
        elif identity.world_size == 1:
            url = f"tcp://127.0.0.1:{_free_port()}"
            dist.init_process_group(
                backend=backend, init_method=url, rank=0, world_size=1, timeout=timeout
            )
        else:
            raise RuntimeError(
                f"WORLD_SIZE={identity.world_size} but MASTER_ADDR is not set; "
                "launch with torchrun or set MASTER_ADDR and MASTER_PORT"
            )
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", identity.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    logger.info(
        "rank %d/%d: process group ready (backend=%s, device=%s)", rank, world, backend, device
    )
    return DistContext(
        rank=rank, world_size=world, local_rank=identity.local_rank, device=device, backend=backend
    )


def close_distributed() -> None:
    """Destroy the default process group if this process created or joined one."""
    ckpt.close()  # drain a background save, if any
    release_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
