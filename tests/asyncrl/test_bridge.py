"""The split placement's control broadcast on 3 real ranks (gloo): every rank gets training rank 0's message, also
when another training rank's own payload pickles to another length (it is not sent)."""
import pytest

from dist_testutil import run_ranks

pytestmark = pytest.mark.slow  # several processes

WORKER = r'''
import json, os, sys
from verl_ds.asyncrl.bridge import _REQUEST, _control
from verl_ds.asyncrl.placement import split_groups

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
pl = split_groups(rank, world, "127.0.0.1", int(os.environ["MASTER_PORT"]), rollout_ranks=1, timeout_s=60)
payload = {"from": rank, "note": "x" * (300 if rank == 0 else 3)} if pl.role == "train" else None
cmd, code, msg = _control(pl.bridge, _REQUEST, 7, payload=payload)
json.dump({"role": pl.role, "cmd": cmd, "code": code, "msg": msg}, open(sys.argv[1] % rank, "w"))
'''


def test_every_rank_gets_training_rank_0s_message(tmp_path):
    results = run_ranks(WORKER, 3, tmp_path, timeout=300)
    assert [r["role"] for r in results] == ["train", "train", "rollout"]
    assert all((r["cmd"], r["code"], r["msg"]) == (2, 7, {"from": 0, "note": "x" * 300}) for r in results), results
