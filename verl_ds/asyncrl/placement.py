"""Split placement's process groups and weight path (docs/async.md, "Placement recipes"): the training ranks' own
default group, a gloo bridge over every rank for control and samples, on CUDA an NCCL group for the weights. They go
from training rank 0 one module's ZeRO-3 gather at a time, in buckets of at most ``bucket_bytes``, never through
files; both sides derive the bucket plan from the model's (name, shape, dtype) list, checked by its digest."""
from __future__ import annotations

import datetime
import hashlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from verl_ds.weights.hf_weights import weight_groups
from verl_ds.weights.zero3 import gathered

DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass
class Placement:
    """This rank's role ("train" or "rollout"), the bridge over every rank, the training ranks' count and ``weights``,
    the group the weight buckets take (None: the bridge)."""
    role: str
    bridge: object
    rank: int
    world: int
    n_train: int
    weights: object = None
    device: str = "cpu"

    @property
    def weight_group(self):
        return self.bridge if self.weights is None else self.weights


def weight_backend(device) -> str:
    """nccl when the ranks compute on CUDA (the weight buckets stay on the GPUs), else gloo."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def rank_device(device: str, local_rank: int) -> str:
    """This rank's device for ``trainer.device``: one GPU per local rank, as ``init_distributed`` picks it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if torch.device(device).type != "cuda":
        return device
    return f"cuda:{local_rank % max(1, torch.cuda.device_count())}"


def _nccl_group(store, rank: int, world: int, timeout: datetime.timedelta):
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout  # as torch.distributed's own group helper sets it (no public setter)
    return dist.ProcessGroupNCCL(store, rank, world, opts)


def split_groups(rank: int, world: int, master_addr: str, master_port: int, rollout_ranks: int,
                 timeout_s: float, device: str = "cpu") -> Placement:
    """The training ranks' default group, the bridge over all ranks and, on CUDA, the NCCL weight group."""
    if not 1 <= rollout_ranks < world:
        raise ValueError(f"split placement needs 1 <= rollout ranks < world size {world}, got {rollout_ranks}")
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = weight_backend(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))  # NCCL binds each rank's communicator to its current device
    store = dist.TCPStore(master_addr, master_port, world_size=None, is_master=rank == 0, wait_for_workers=False,
                          timeout=timeout)
    n_train = world - rollout_ranks
    if rank < n_train and not dist.is_initialized():
        dist.init_process_group(backend, store=dist.PrefixStore("train", store), rank=rank, world_size=n_train,
                                timeout=timeout)
    bridge = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, world, timeout)
    weights = _nccl_group(dist.PrefixStore("weights", store), rank, world, timeout) if backend == "nccl" else None
    return Placement("train" if rank < n_train else "rollout", bridge, rank, world, n_train, weights, str(device))


def _entries(module) -> list:
    return [(name, tuple(shape), dtype) for _, outs in weight_groups(module) for name, shape, dtype, _ in outs]


def _plan(entries: list, bucket_bytes: int) -> list:
    """Entry indices per bucket: consecutive entries of one dtype, at most ``bucket_bytes`` (a larger one alone)."""
    buckets, size = [], 0
    for i, (_, shape, dtype) in enumerate(entries):
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        if buckets and (size + nbytes > bucket_bytes or entries[buckets[-1][0]][2] != dtype):
            buckets.append([])
            size = 0
        if not buckets:
            buckets.append([])
        buckets[-1].append(i)
        size += nbytes
    return buckets


def _check_plan(entries: list, placement: Placement) -> None:
    digest = hashlib.sha256(repr([(n, s, str(d)) for n, s, d in entries]).encode()).digest()[:8]
    mine = torch.tensor([int.from_bytes(digest, "little", signed=True)], dtype=torch.int64)
    theirs = mine.clone()
    placement.bridge.broadcast(theirs, 0).wait()
    if not torch.equal(mine, theirs):
        raise RuntimeError(f"rank {placement.rank}: the generation model's weights (names, shapes, dtypes) differ from "
                           f"the trainer's; both sides must build the same model (model.*)")


def send_weights(module, placement: Placement, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Every training rank: broadcast the weights from training rank 0 (each module's ZeRO-3 gather is a collective of
    the training ranks); returns the seconds it took."""
    t0 = time.perf_counter()
    groups = weight_groups(module)
    entries = _entries(module)
    _check_plan(entries, placement)
    ends = {bucket[-1] for bucket in _plan(entries, bucket_bytes)}
    pending, i = [], 0
    for params, outs in groups:
        with gathered(params):
            for name, _, _, produce in outs:
                pending.append(produce().detach().reshape(-1).to(placement.device, copy=True))
                if i in ends:
                    placement.weight_group.broadcast(torch.cat(pending), 0).wait()
                    pending = []
                i += 1
    return time.perf_counter() - t0


@torch.no_grad()
def receive_weights(model, placement: Placement, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> float:
    """Every generation rank: receive the trainer's weights into ``model`` (the same architecture) in place; seconds."""
    t0 = time.perf_counter()
    entries = _entries(model)
    _check_plan(entries, placement)
    targets = dict(model.named_parameters(remove_duplicate=False))
    for bucket in _plan(entries, bucket_bytes):
        sizes = [torch.Size(entries[i][1]).numel() for i in bucket]
        flat = torch.empty(sum(sizes), dtype=entries[bucket[0]][2], device=placement.device)
        placement.weight_group.broadcast(flat, 0).wait()
        for i, part in zip(bucket, flat.split(sizes)):
            name, shape, _ = entries[i]
            targets[name].copy_(part.view(shape))
    return time.perf_counter() - t0
