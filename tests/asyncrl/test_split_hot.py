"""Split placement (rank 0 trains, rank 1 only generates) with the control server on 127.0.0.1: a PATCH of the
sampling keys and a reward swap, answered 202 for step s, reach the generation rank at the same step boundary as
the trainer: the batch it makes during step s (trained at s + 1, ``async/generated_at_step`` = s) is sampled with
the new keys and scored by the new reward; the batches made before are not."""
import os
import signal
import subprocess
import sys

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, free_port, merged, read_metrics, wait_until
from server_testutil import TOKEN, call

pytestmark = pytest.mark.slow  # a real 2-rank training run

CONST = 0.123  # the parity reward never scores a batch this
SPLIT = ["algo.adv_estimator=grpo", "rollout.n=2", "rollout.batch_size=4", "actor.mini_batch_size=8",
         "actor.micro_batch_size=4", "rollout.mode=one_step_off", "rollout.split_ranks=1", "trainer.export=none",
         "trainer.val_every=0", "trainer.save_every=0", "trainer.total_steps=400", "server.enabled=true",
         "server.allow_reward_code=true"]


def _rows(out: str) -> dict:
    if not os.path.isfile(os.path.join(out, "metrics.jsonl")):
        return {}
    return {m["step"]: m for m in read_metrics(out) if "training/global_step" in m}


def _start(out: str, log: str, overrides=()):
    args = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", TRAIN,
            *merged([f"trainer.output_dir={out}"], FAST, SPLIT, list(overrides))]
    with open(log, "w") as fh:
        proc = subprocess.Popen(args, cwd=ROOT, env=base_env(VERL_DS_SERVER_TOKEN=TOKEN), stdout=fh,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url_file = os.path.join(out, "server_url.txt")
    try:
        url = wait_until(proc, lambda: os.path.isfile(url_file) and open(url_file).read().strip(), "the server URL", log)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return proc, url


def test_a_patch_and_a_reward_swap_reach_the_generation_rank_at_their_step(tmp_path):
    (tmp_path / "const.py").write_text(f"def const(prompts, responses, batch):\n    return [{CONST}] * len(responses)\n")
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")
    proc, url = _start(out, log)
    try:
        wait_until(proc, lambda: _rows(out), "step 1 was logged", log)
        patch = call(url, "PATCH", "/v1/state", {"max_new_tokens": 2, "temperature": 0.5}, token=TOKEN)
        swap = call(url, "POST", "/v1/models/reward", {"function": f"{tmp_path}/const.py:const"}, token=TOKEN)
        assert patch.status == 202 and swap.status == 202, (patch, swap)
        at_patch, at_swap = patch.json["applies_at_step"], swap.json["applies_at_step"]
        last = max(at_patch, at_swap) + 2  # the batch made during step s is trained at s + 1
        wait_until(proc, lambda: last in _rows(out), f"step {last} was logged", log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the rows needed are written; the run has 400 steps to go
        proc.wait()
    rows = sorted(_rows(out).values(), key=lambda r: r["step"])
    made = [(int(r["async/generated_at_step"]), r) for r in rows]
    assert {g for g, _ in made} >= {at_patch - 1, at_patch, at_swap - 1, at_swap}, [g for g, _ in made]
    for g, r in made:
        if g >= at_patch:  # sampled with the patched keys
            assert r["response_length/mean"] <= 2.0, (g, at_patch, r["response_length/mean"])
        else:  # the tiny random model almost never stops before rollout.max_new_tokens=6
            assert r["response_length/mean"] > 2.0, (g, at_patch, r["response_length/mean"])
        if g >= at_swap:  # scored by the swapped-in reward on the generation rank
            assert abs(r["rollout/score/mean"] - CONST) < 1e-6, (g, at_swap, r["rollout/score/mean"])
        else:
            assert abs(r["rollout/score/mean"] - CONST) > 1e-3, (g, at_swap, r["rollout/score/mean"])
    # the SharedState version the generation rank sampled under follows the trainer's (it only grows)
    versions = [r["async/state_version"] for _, r in made]
    assert versions == sorted(versions) and versions[-1] > versions[0]


def test_a_lowered_max_staleness_reaches_the_streaming_generation_rank_at_its_step(tmp_path):
    """rollout.mode=streaming on split ranks with max_staleness 1; a PATCH to 0 answered for step s: from step s on
    every group trained is on-policy (a group made ahead is regenerated), and the generation rank waits for each
    request before it starts the batch."""
    out, log = str(tmp_path / "run"), str(tmp_path / "run.log")
    proc, url = _start(out, log, ["rollout.mode=streaming", "rollout.max_staleness=1"])
    try:
        wait_until(proc, lambda: len(_rows(out)) >= 2, "step 2 was logged", log)
        patch = call(url, "PATCH", "/v1/state", {"max_staleness": 0}, token=TOKEN)
        assert patch.status == 202, patch
        at = patch.json["applies_at_step"]
        wait_until(proc, lambda: at + 2 in _rows(out), f"step {at + 2} was logged", log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rows = _rows(out)
    assert max(rows[s]["async/staleness/max"] for s in rows if 1 < s < at) == 1  # it ran ahead before
    for s in (at, at + 1, at + 2):
        assert rows[s]["async/staleness/max"] == 0 and rows[s]["async/staleness_hist/0"] == 4, rows[s]
    assert rows[at]["async/regenerated"] > 0  # the group made ahead under the old bound went stale
