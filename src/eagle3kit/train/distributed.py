"""Several processes training one drafter (``torchrun``): torch.distributed set-up and the few
collective steps ``train`` needs. Without ``torchrun`` (no ``WORLD_SIZE`` in the environment)
everything here is a no-op on a world of one.

Launch::

    torchrun --nproc-per-node 8 -m eagle3kit train -c run.yaml

Each process takes GPU ``LOCAL_RANK`` (NCCL), or the CPU (gloo) when the run's device is the CPU;
the target is replicated, one copy per process, and the drafter is wrapped in
DistributedDataParallel (``train.parallel: ddp``) or sharded with FSDP2 (``fsdp``).

``eagle3kit run`` under ``torchrun`` (:class:`Launch`): rank 0 runs the stages that are not
distributed (prompts, generate, tokenize, vocab; then export and evaluate) while the other ranks
wait on torchrun's own store (:meth:`Launch.wait_for_rank0`), not in a collective, so no process
group exists while rank 0 runs an engine of its own (vLLM makes its own).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import yaml

# torch.distributed's checkpoint, device-mesh and FSDP modules are imported where they are used: together
# they take about 0.7 s to import, which every eagle3kit command paid, training or not
from eagle3kit.core.config import ConfigError
from eagle3kit.core.rundir import DataError


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
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            fully_shard(module, mesh=init_device_mesh(self.device.type, (self.size,)))
            return module
        ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(module, device_ids=ids)


def parallel_mode(module: torch.nn.Module) -> str:
    """How ``module`` is spread over the processes, read from the module itself (not from the config):
    ``fsdp`` (sharded by FSDP2), ``ddp`` (in DistributedDataParallel) or ``none``."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(module, FSDPModule):
        return "fsdp"
    if isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return "ddp"
    return "none"


def full_state(module: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> tuple[dict, dict | None]:
    """The whole (unsharded, on the CPU) model state and optimizer state, keyed by parameter
    name, whether ``module`` is plain, in DDP or sharded by FSDP2 — a collective under FSDP2:
    every process must call it (torch.distributed.checkpoint.state_dict)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

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
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(module, model, options=opts)
    if opt is not None and opt_state is not None:
        set_optimizer_state_dict(module, opt, optim_state_dict=opt_state, options=opts)


def init_world(device: torch.device) -> World:
    """Join the process group ``torchrun`` describes (NCCL on CUDA, gloo on the CPU).

    Args:
        device: the device the run asked for; on CUDA each process takes ``cuda:LOCAL_RANK``.
    Raises:
        ConfigError: ``WORLD_SIZE`` > 1 without torchrun's other variables.
        RuntimeError: torchrun's rendezvous failed (torch.distributed's message), or a process group
            of another size already exists in this process.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World(device=device)
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ConfigError(
            f"WORLD_SIZE is {size} but {', '.join(missing)} unset: launch with torchrun "
            "(`torchrun --nproc-per-node N -m eagle3kit train …`), or unset WORLD_SIZE for one process"
        )
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    elif dist.get_world_size() != size:  # another library's group (an in-process vLLM engine's) is not ours
        raise RuntimeError(
            f"a process group of {dist.get_world_size()} process(es) already exists in this process, not torchrun's "
            f"{size}: release what made it (an in-process vLLM engine) before training"
        )
    return World(rank=dist.get_rank(), size=dist.get_world_size(), device=device)


def end_world() -> None:
    """Leave the process group :func:`init_world` joined (every process, after training), so that
    rank 0 can start an engine with a process group of its own (vLLM's) for export and evaluate."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@dataclass
class Launch:
    """How this process was launched: ``rank`` of ``size`` (torchrun's ``RANK``/``WORLD_SIZE``;
    0 of 1 without torchrun), ``local_rank`` on its node, ``node`` (torchrun's ``GROUP_RANK``)."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    node: int = 0

    @classmethod
    def from_env(cls) -> "Launch":
        """Read torchrun's environment. Raises ConfigError when ``WORLD_SIZE`` > 1 was set by
        another launcher than torchrun (no agent store to wait on)."""
        e = os.environ
        out = cls(
            int(e.get("RANK", 0)),
            int(e.get("WORLD_SIZE", 1)),
            int(e.get("LOCAL_RANK", 0)),
            int(e.get("GROUP_RANK", 0)),
        )
        if out.size > 1 and e.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            raise ConfigError(
                f"WORLD_SIZE {out.size} without torchrun's agent store (TORCHELASTIC_USE_AGENT_STORE): launch "
                "`eagle3kit run` with torchrun (`torchrun --nproc-per-node N -m eagle3kit run -c CONFIG`)"
            )
        return out

    def _store(self) -> dist.Store:
        """torchrun's agent store (the TCPStore its rendezvous serves at MASTER_ADDR:MASTER_PORT), its
        keys prefixed by this run and restart so an earlier attempt's keys are never read."""
        e = os.environ
        store = dist.TCPStore(
            e["MASTER_ADDR"], int(e["MASTER_PORT"]), is_master=False, timeout=timedelta(days=30)
        )
        prefix = (
            f"eagle3kit/{e.get('TORCHELASTIC_RUN_ID', 'run')}/{e.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
        )
        return dist.PrefixStore(prefix, store)

    def announce(self, key: str, outcome: str = "ok") -> None:
        """Rank 0: tell every waiting rank that ``key`` is done (``outcome`` "ok", or why it failed)."""
        if self.size > 1 and self.rank == 0:
            self._store().set(key, outcome)

    def agree(self, key: str, config_yaml: str) -> None:
        """Every rank: stop unless every rank was launched with the same config (``config_yaml``, the
        config as :func:`eagle3kit.core.config.dump_config` writes it): ranks given other settings would
        train other replicas and exit 0, with config.yaml recording rank 0's alone. Each rank posts its
        config under ``key`` in torchrun's store and compares every rank's with rank 0's, so all stop
        together, before anything is read or written.

        Raises:
            ConfigError: naming the first rank that differs and up to five keys with both values."""
        if self.size == 1:
            return
        store = self._store()
        store.set(f"{key}/{self.rank}", config_yaml)
        keys = [f"{key}/{r}" for r in range(self.size)]
        store.wait(keys)
        first = store.get(keys[0]).decode()
        for r in range(1, self.size):
            other = store.get(keys[r]).decode()
            if other != first:
                raise ConfigError(
                    f"rank {r} was launched with another config than rank 0 ({config_diff(first, other, r)}): "
                    "give every process the same config file and flags"
                )

    def wait_for_rank0(self, key: str) -> None:
        """Every other rank: wait, without a timeout, until rank 0 has announced ``key``.

        Raises:
            DataError: rank 0 announced a failure (its message)."""
        if self.size == 1 or self.rank == 0:
            return
        store = self._store()
        store.wait([key])
        outcome = store.get(key).decode()
        if outcome != "ok":
            raise DataError(f"rank 0 stopped before training: {outcome}")


def config_diff(first: str, other: str, rank: int, most: int = 5) -> str:
    """``"train.lr: 0.0003 on rank 0, 0.03 on rank R; …"``: the dotted keys whose values differ between two
    configs as YAML text (at most ``most``, then how many more)."""

    def flat(d, prefix=""):
        out = {}
        for k, v in (d or {}).items():
            if isinstance(v, dict) and v:
                out.update(flat(v, f"{prefix}{k}."))
            else:
                out[f"{prefix}{k}"] = v
        return out

    a, b = flat(yaml.safe_load(first)), flat(yaml.safe_load(other))
    keys = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    said = [f"{k}: {a.get(k)} on rank 0, {b.get(k)} on rank {rank}" for k in keys[:most]]
    return "; ".join(said) + (f"; {len(keys) - most} more" if len(keys) > most else "")
