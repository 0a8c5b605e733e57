"""Several processes training one drafter (``torchrun``): torch.distributed set-up and the few
collective steps ``train`` needs. Without ``torchrun`` (no ``WORLD_SIZE`` in the environment)
everything here is a no-op on a world of one.

Launch::

    torchrun --nproc-per-node 8 -m eagle3kit train -c run.yaml

Each process takes GPU ``LOCAL_RANK`` (NCCL), or the CPU (gloo) when the run's device is the CPU;
the target is replicated, one copy per process, and the drafter is wrapped in
DistributedDataParallel.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class World:
    """Where this process stands: ``rank`` of ``size`` processes, on ``device``."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def main(self) -> bool:
        """The process that writes checkpoints, logs and the report (rank 0)."""
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over all processes."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t)

    def sum_floats(self, values: list[float]) -> list[float]:
        """Element-wise sums over all processes."""
        if self.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every process's ``values`` (same length everywhere), indexed by rank."""
        if self.size == 1:
            return [values]
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t)
        return [o.tolist() for o in out]

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """``module`` in DistributedDataParallel over this world (itself on a world of one)."""
        if self.size == 1:
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def init_world(device: torch.device) -> World:
    """Join the process group ``torchrun`` describes (NCCL on CUDA, gloo on the CPU).

    Args:
        device: the device the run asked for; on CUDA each process takes ``cuda:LOCAL_RANK``.
    Raises:
        RuntimeError: torchrun's rendezvous failed (torch.distributed's message).
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=device)
