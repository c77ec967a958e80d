"""Launcher detection: python, torchrun, deepspeed, accelerate, srun; inconsistent variables fail early."""
import os
import sys

import pytest

from verl_ds.dist import LaunchError, detect_launch, expand_nodelist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engines"))
from dist_testutil import run_ranks  # noqa: E402


def test_plain_python_is_world_size_one():
    info = detect_launch({})
    assert (info.rank, info.world_size, info.local_rank, info.launcher) == (0, 1, 0, "python")
    assert info.master_port > 0


def test_torchrun_variables():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234",
           "TORCHELASTIC_RUN_ID": "x"}
    info = detect_launch(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port, info.launcher) == \
        (3, 4, 1, "10.0.0.1", 1234, "torchrun")


def test_deepspeed_local_rank_argument():
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511"}
    info = detect_launch(env, local_rank_arg=1)
    assert (info.rank, info.local_rank, info.launcher) == (1, 1, "deepspeed")


def test_accelerate_is_recognised():
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29512",
           "ACCELERATE_USE_DEEPSPEED": "true"}
    assert detect_launch(env).launcher == "accelerate"


def test_slurm_variables_and_nodelist():
    env = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8", "SLURM_NODELIST": "gpu[07-08,10],cpu1",
           "SLURM_JOB_ID": "4242"}
    info = detect_launch(env)
    assert (info.rank, info.local_rank, info.world_size, info.master_addr, info.launcher) == (5, 1, 8, "gpu07", "slurm")
    assert info.master_port == 29500 + 4242 % 1000
    assert expand_nodelist("n[1-3]") == ["n1", "n2", "n3"]
    assert expand_nodelist("a[001-002],b") == ["a001", "a002", "b"]


@pytest.mark.parametrize("env, kw, message", [
    ({"WORLD_SIZE": "2"}, {}, r"RANK=None, WORLD_SIZE='2'"),
    ({"RANK": "2", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, {}, r"rank 2 is outside the world of size 2"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, {}, r"WORLD_SIZE=2 but MASTER_PORT is not set"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, {}, r"RANK='x' is not an integer"),
    ({"RANK": "0", "WORLD_SIZE": "0", "MASTER_PORT": "1"}, {}, r"world size must be >= 1"),
    ({}, {"local_rank_arg": 1}, r"--local_rank=1 was given but RANK/WORLD_SIZE are not set"),
    ({"SLURM_PROCID": "0"}, {}, r"SLURM_NTASKS is not"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, {}, r"rank 4 is outside the world of size 4"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "MASTER_PORT": "1"}, {}, r"local rank 2 is inconsistent with rank 1"),
])
def test_inconsistent_launch_variables(env, kw, message):
    with pytest.raises(LaunchError, match=message):
        detect_launch(env, **kw)


SHUTDOWN_WORKER = r'''
import json, os, sys
import torch
import torch.distributed as dist
from verl_ds import dist as vdist
vdist.init_distributed(vdist.detect_launch(), 60, "cpu")
t = torch.tensor([float(vdist.rank() + 1)])
dist.all_reduce(t)
vdist.shutdown()
after = dist.is_initialized()
vdist.shutdown()  # a second call (an error path that already ended the group) is a no-op
res = {"sum": float(t), "initialized_after": after, "world_after": vdist.world_size()}
json.dump(res, open(sys.argv[1] % int(os.environ["RANK"]), "w"))
'''


@pytest.mark.slow
def test_shutdown_ends_the_process_group_on_every_rank(tmp_path):
    results = run_ranks(SHUTDOWN_WORKER, 2, tmp_path, timeout=120)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert all(r["initialized_after"] is False and r["world_after"] == 1 for r in results)


EXIT_WORKER = r'''
import atexit, json, os, sys
import torch.distributed as dist
from verl_ds import dist as vdist
# registered first, so it runs last (atexit is last in, first out): after verl_ds's own exit handler
atexit.register(lambda: json.dump({"initialized_at_exit": dist.is_initialized()},
                                  open(sys.argv[1] % int(os.environ["RANK"]), "w")))
vdist.init_distributed(vdist.detect_launch(), 60, "cpu")
vdist.barrier()
'''


@pytest.mark.slow
def test_a_rank_that_returns_without_shutdown_ends_its_group_at_exit(tmp_path):
    results = run_ranks(EXIT_WORKER, 2, tmp_path, timeout=120, end=False)  # the interpreter's own exit
    assert [r["initialized_at_exit"] for r in results] == [False, False]
