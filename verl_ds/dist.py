"""Rank, world size and master address from whatever launched us (python, torchrun, deepspeed, accelerate, srun), and
torch.distributed set-up; inconsistent variables are an error before any collective (docs/launch.md)."""
from __future__ import annotations

import atexit
import math
import os
import re
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


class LaunchError(RuntimeError):
    """The launcher's environment is inconsistent; the message names the variables."""


@dataclass(frozen=True)
class LaunchInfo:
    rank: int
    local_rank: int
    world_size: int
    master_addr: str
    master_port: int
    launcher: str  # python | torchrun | deepspeed | accelerate | slurm

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def expand_nodelist(nodelist: str) -> list[str]:
    """``gpu[01-03,07],cpu5`` -> host names, as ``scontrol show hostnames`` expands a Slurm node list."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if not prefix:
            continue
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            if "-" in part:
                lo, hi = part.split("-", 1)
                width = len(lo)
                hosts.extend(f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi) + 1))
            else:
                hosts.append(prefix + part)
    return hosts


def _int_env(env, name) -> Optional[int]:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(f"environment variable {name}={raw!r} is not an integer") from None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def detect_launch(env=None, local_rank_arg: Optional[int] = None) -> LaunchInfo:
    """Read the launch variables; raise LaunchError when they contradict each other."""
    env = os.environ if env is None else env
    rank, world, local = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE"), _int_env(env, "LOCAL_RANK")
    if rank is None and world is None and env.get("SLURM_PROCID") is not None:
        # srun without torchrun: derive the torch variables from Slurm's
        rank, world = _int_env(env, "SLURM_PROCID"), _int_env(env, "SLURM_NTASKS")
        local = _int_env(env, "SLURM_LOCALID")
        if world is None:
            raise LaunchError("SLURM_PROCID is set but SLURM_NTASKS is not; launch with srun --ntasks=N")
        nodes = expand_nodelist(env.get("SLURM_NODELIST") or env.get("SLURM_JOB_NODELIST") or "127.0.0.1")
        addr = env.get("MASTER_ADDR") or nodes[0]
        port = _int_env(env, "MASTER_PORT") or 29500 + (_int_env(env, "SLURM_JOB_ID") or 0) % 1000
        launcher = "slurm"
    else:
        if local is None and local_rank_arg is not None:
            local = local_rank_arg
        if rank is None and world is None:
            if local_rank_arg not in (None, 0):
                raise LaunchError(f"--local_rank={local_rank_arg} was given but RANK/WORLD_SIZE are not set")
            rank, world, local = 0, 1, 0
        elif rank is None or world is None:
            raise LaunchError(f"inconsistent launch environment: RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}; "
                              "set both (torchrun, deepspeed and accelerate do) or neither (plain python)")
        addr = env.get("MASTER_ADDR") or "127.0.0.1"
        port = _int_env(env, "MASTER_PORT")
        if port is None:
            if world > 1:
                raise LaunchError(f"WORLD_SIZE={world} but MASTER_PORT is not set")
            port = free_port()
        if any(env.get(k) is not None for k in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION",
                                                 "ACCELERATE_DYNAMO_BACKEND", "ACCELERATE_USE_CPU")):
            launcher = "accelerate"
        elif local_rank_arg is not None or env.get("DEEPSPEED_LAUNCHER") is not None:
            launcher = "deepspeed"
        elif env.get("TORCHELASTIC_RUN_ID") is not None:
            launcher = "torchrun"
        else:
            launcher = "python" if world == 1 else "torchrun"
    if world < 1:
        raise LaunchError(f"world size must be >= 1, got {world}")
    if not 0 <= rank < world:
        raise LaunchError(f"rank {rank} is outside the world of size {world} (expected 0 <= rank < {world})")
    if local is None:
        local = rank
    if local < 0 or local > rank:
        raise LaunchError(f"local rank {local} is inconsistent with rank {rank} (expected 0 <= local_rank <= rank)")
    return LaunchInfo(rank=rank, local_rank=local, world_size=world, master_addr=addr, master_port=port, launcher=launcher)


def export_launch_env(info: LaunchInfo) -> None:
    """Make the torch variables explicit: DeepSpeed tries MPI when they are missing, and ignores SLURM_*."""
    os.environ.update({"RANK": str(info.rank), "LOCAL_RANK": str(info.local_rank), "WORLD_SIZE": str(info.world_size),
                       "MASTER_ADDR": info.master_addr, "MASTER_PORT": str(info.master_port)})


def init_distributed(info: LaunchInfo, timeout_s: int, device: str) -> None:
    """Initialise torch.distributed through DeepSpeed (gloo on CPU, nccl on CUDA) with a bounded timeout."""
    import deepspeed

    export_launch_env(info)
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        # with --gpus-per-task=1 / --gpu-bind a task sees only its own GPU(s)
        torch.cuda.set_device(info.local_rank % max(1, torch.cuda.device_count()))
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=timeout_s),
                               rank=info.rank, world_size=info.world_size, auto_mpi_discovery=False)
    atexit.register(_destroy_at_exit)
    global _multi_rank
    _multi_rank = info.world_size > 1


_multi_rank = False  # set by init_distributed: this process is one rank of several (its exit goes by os._exit)


def _destroy_at_exit() -> None:
    # a process that ends without shutdown() (an error, a script that returns) still ends its group (see shutdown);
    # no barrier: another rank may be gone
    if dist.is_initialized():
        dist.destroy_process_group()


def shutdown() -> None:
    """End a finished run's process group (barrier, ``destroy_process_group``) as torch asks: left to the interpreter's
    exit, gloo's threads are torn down unjoined, which can abort a rank after its work is done."""
    if dist.is_initialized():
        barrier()
        dist.destroy_process_group()


def exit_after_shutdown(code: int, world: int) -> int:
    """A finished multi-rank process ends here after ``shutdown()``, by ``os._exit``: it skips the C++ thread teardown
    that sometimes aborted a finished rank (exit -6, pytorch/pytorch#179291). A single process returns ``code``."""
    return code if world <= 1 else _leave(code)


def _leave(code: int) -> int:
    """Flush logs and streams, then ``os._exit(code)``: no interpreter teardown."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def multi_rank_process() -> bool:
    return _multi_rank


def end_failed_process(code: int) -> int:
    """A failing or preempted rank of a multi-rank run ends here: exit handlers run (ending the process group), then
    ``os._exit(code)``, so a teardown abort cannot replace 75 by -6 (a preempted job would not be requeued)."""
    if not _multi_rank:
        return code
    atexit._run_exitfuncs()  # what the interpreter would run at exit; the C++ finalisation is what os._exit skips
    return _leave(code)


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _several() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _several():
        dist.barrier()


def comm_device() -> torch.device:
    """Where collective buffers must live: NCCL only reduces CUDA tensors, gloo CPU ones."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum a tensor over ranks (returned on ``t``'s device); a no-op at world size 1."""
    if _several():
        buf = t.to(comm_device())
        dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        return buf.to(t.device)
    return t


def any_rank(local: bool) -> bool:
    """Collective: whether ``local`` is True on any rank."""
    flag = torch.tensor([1.0 if local else 0.0])
    return all_reduce_sum(flag).item() > 0


def gather_object(obj) -> list:
    """Collective: every rank's ``obj``, in rank order, on every rank."""
    if not _several():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not _several():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def global_masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening with mean and (Bessel-corrected) variance over every data-parallel rank's tokens."""
    m = mask.to(torch.float64)
    xd = torch.where(mask, x.to(torch.float64), torch.zeros((), dtype=torch.float64))
    n, s, ss = all_reduce_sum(torch.stack([m.sum(), xd.sum(), (xd * xd).sum()])).tolist()
    if n < 2:
        raise ValueError(f"cannot whiten advantages over {int(n)} valid token(s) across all ranks; need at least 2")
    mean = s / n
    var = (ss - n * mean * mean) / (n - 1)
    return ((x.to(torch.float64) - mean) / math.sqrt(max(var, 0.0) + eps)).to(torch.float32)


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's global RNGs from one seed (each rank passes its own)."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
