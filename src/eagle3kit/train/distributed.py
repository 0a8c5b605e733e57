"""Several processes training one drafter (``torchrun``): torch.distributed set-up and the few
collective steps ``train`` needs. Without ``torchrun`` (no ``WORLD_SIZE`` in the environment)
everything here is a no-op on a world of one.

Launch::

    torchrun --nproc-per-node 8 -m eagle3kit train -c run.yaml

Each process takes GPU ``LOCAL_RANK`` (NCCL), or the CPU (gloo) when the run's device is the CPU;
the target is replicated, one copy per process, and the drafter is wrapped in
DistributedDataParallel (``train.parallel: ddp``) or sharded with FSDP2 (``fsdp``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard


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

    def wrap(self, module: torch.nn.Module, parallel: str = "ddp") -> torch.nn.Module:
        """``module`` data-parallel over this world (itself on a world of one).

        ``parallel``: ``"ddp"`` — DistributedDataParallel (replicated weights, all-reduced
        gradients; returns the wrapper); ``"fsdp"`` — FSDP2 ``fully_shard`` (weights, gradients
        and optimizer state sharded over the processes; shards ``module`` in place and returns it).
        """
        if self.size == 1:
            return module
        if parallel == "fsdp":
            fully_shard(module, mesh=init_device_mesh(self.device.type, (self.size,)))
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def full_state(module: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """The whole (unsharded, on the CPU) model state and optimizer state, keyed by parameter
    name, whether ``module`` is plain, in DDP or sharded by FSDP2 — a collective under FSDP2:
    every process must call it (torch.distributed.checkpoint.state_dict)."""

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    model = get_model_state_dict(module, options=opts)
    return model, (get_optimizer_state_dict(module, opt, options=opts) if opt is not None else None)


def load_full_state(
    module: torch.nn.Module,
    model: dict,
    opt: torch.optim.Optimizer | None = None,
    opt_state: dict | None = None,
) -> None:
    """Inverse of :func:`full_state` (every process passes the whole state; each keeps its shard)."""

    opts = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(module, model, options=opts)
    if opt is not None and opt_state is not None:
        set_optimizer_state_dict(module, opt, optim_state_dict=opt_state, options=opts)


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
