"""Two processes (gloo, started by hand as torchrun would: RANK/WORLD_SIZE/MASTER_* env): sync() gives every
rank rank 0's values; a write on rank 1 is refused; SharedState.from_config agrees on every rank."""
import pytest
import os
import socket
import sys
import tempfile

pytestmark = pytest.mark.slow  # real training runs / several processes

WORKER = r'''
import json, os, sys
import torch.distributed as dist
from verl_ds.state import SharedState

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=2)
s = SharedState()  # rank read from torch.distributed
out = {"rank": s.rank}
if rank == 0:
    s.update({"kl_coef": 0.25, "global_step": 3, "reward_name": "parity"})
    s.stage({"top_k": 17}, client="test")
    s.apply_staged()
else:
    try:
        s.set("kl_coef", 9.0)
        out["write_error"] = None
    except RuntimeError as e:
        out["write_error"] = str(e)
s.sync()
# a state built from the config holds the same step-0 values and limits on every rank, without a collective
from verl_ds.config import load_config
from verl_ds.state import StateValidationError

t = SharedState.from_config(load_config(None, ["algo.kl_placement=loss", "data.max_prompt_length=200"]))
out["from_config"] = [t.snapshot(), t.version]
if rank == 0:
    try:
        t.stage({"max_new_tokens": 57})
    except StateValidationError as e:
        out["limit_error"] = e.errors["max_new_tokens"]
out["values"] = s.snapshot()
out["version"] = s.version
dist.barrier()
dist.destroy_process_group()
with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_sync_two_ranks():
    import json
    import subprocess

    port = _free_port()
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "worker.py")
        with open(script, "w") as f:
            f.write(WORKER)
        procs = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, script, tmp], env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT))
        outputs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=60)
                outputs.append(out.decode(errors="replace"))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
        assert all(p.returncode == 0 for p in procs), outputs
        r0, r1 = (json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(2))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r1["write_error"].startswith("SharedState.set/update called on rank 1: only rank 0 mutates")
    assert r1["values"] == r0["values"]
    assert r1["values"]["kl_coef"] == 0.25 and r1["values"]["top_k"] == 17 and r1["values"]["global_step"] == 3
    assert r1["version"] == r0["version"] > 0
    assert r1["from_config"] == r0["from_config"] and r0["from_config"][0]["kl_kind"] == "low_var_kl"
    assert r0["limit_error"].startswith("57 exceeds this run's limit 56 (model.config_overrides.max_position_embeddings=256 - "
                                        "data.max_prompt_length=200")

