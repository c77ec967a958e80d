"""The SFT, reward-model and DPO jobs run under the RL job's loop and so get its reliability: a non-finite step is
skipped on every rank and leaves the guard's forensic record (``<run>/nonfinite/step_<N>.json``); SIGUSR1 to every
task (as Slurm sends it) checkpoints the finished steps and exits 75; the run resumes at another world size and goes
on as the run that had that world size all along."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from e2e_utils import ROOT, base_env, free_port, merged
from reliability_testutil import Job
from test_pref_jobs_dist import FAST, assert_same_run, rows, run_stage

from verl_ds.checkpoint import verify
from verl_ds.config import load_config
from verl_ds.dist import detect_launch

pytestmark = pytest.mark.slow


def jobs():
    from verl_ds.stages.dpo import DPOJob
    from verl_ds.stages.rm import RewardModelJob
    from verl_ds.stages.sft import SFTJob

    return {"sft": SFTJob, "rm": RewardModelJob, "dpo": DPOJob}


@pytest.fixture(scope="module")
def nan_model(tmp_path_factory):
    """A tiny Llama whose final norm holds a NaN: every logit, score and loss of every job is NaN."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from verl_ds.tokenizer import build_tokenizer

    tok = build_tokenizer()
    model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                         num_hidden_layers=1, num_attention_heads=4,
                                                         num_key_value_heads=2, pad_token_id=tok.pad_token_id))
    with torch.no_grad():
        model.model.norm.weight[3] = float("nan")
    path = tmp_path_factory.mktemp("nan") / "model"
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_a_non_finite_step_is_skipped_with_the_forensic_record_and_the_run_stops(tmp_path, nan_model, stage):
    from verl_ds.runtime import NonFiniteError

    out = tmp_path / "run"
    cfg = load_config(None, merged([f"trainer.output_dir={out}"], FAST, [f"model.path={nan_model}",
                                   "trainer.total_steps=5", "trainer.max_bad_steps=2", "trainer.save_every=0"]))
    job = jobs()[stage](cfg, detect_launch({}))
    before = {n: p.ds_tensor.clone() for n, p in job.engine.module.named_parameters() if p.requires_grad}
    with pytest.raises(NonFiniteError, match="2 consecutive steps with non-finite values") as raised:
        job.fit()
    after = dict(job.engine.module.named_parameters())
    for name, was in before.items():  # no update was applied (the NaN stays a NaN)
        torch.testing.assert_close(after[name].ds_tensor, was, rtol=0, atol=0, equal_nan=True, msg=name)
    logged = [r for r in rows(out).values() if r["step"] > 0]
    assert [r["training/consecutive_bad_steps"] for r in logged] == [1.0, 2.0]
    assert raised.value.record == str(out / "nonfinite" / "step_2.json")
    for step in (1, 2):
        record = json.load(open(out / "nonfinite" / f"step_{step}.json"))
        assert (record["step"], record["kind"], record["consecutive_bad_steps"]) == (step, "update", step)
        (event,) = record["update_events"]
        assert event["role"] == "actor" and event["skipped"] and set(event["nonfinite_losses"]) == {"nan"}
    # as the RL job does, the run ends with a checkpoint of the steps so far (skipped updates: the initial weights)
    assert verify(str(out / "checkpoints" / "global_step_2")) is None


def start_ranks(stage: str, out, overrides, nproc: int) -> Job:
    """``nproc`` processes of launch/<stage>.py, one per rank (as srun starts them), so each can be signalled."""
    port, logs, procs = free_port(), [], []
    args = merged([f"trainer.output_dir={out}"], FAST, overrides)
    for rank in range(nproc):
        env = base_env(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=nproc, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        logs.append(str(out) + f".rank{rank}.log")
        with open(logs[-1], "w") as fh:
            procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "launch", f"{stage}.py"), *args],
                                          cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT))
    return Job(procs, logs, str(out))


@pytest.mark.parametrize("stage", ["sft", "rm", "dpo"])
def test_usr1_exits_75_and_the_run_resumes_on_one_rank_as_the_one_rank_run(tmp_path, stage):
    """Two ranks train the first steps as one rank does, stop on SIGUSR1 with a checkpoint and exit 75; resumed on
    one rank, the run goes on as the run that had one rank from the start."""
    out = tmp_path / "two"
    job = start_ranks(stage, out, ["trainer.total_steps=1000", "trainer.save_every=0", "trainer.val_every=0"], 2)
    job.wait_for(lambda: os.path.isfile(out / "metrics.jsonl") and any(r["step"] > 0 for r in rows(out).values()),
                 600, "step 1")
    for rank in range(2):  # as Slurm signals every task of the job
        job.signal(rank, signal.SIGUSR1)
    assert job.wait(300) == [75, 75], job.tail()
    s = int(open(out / "checkpoints" / "latest").read().split("_")[-1])
    step_dir = out / "checkpoints" / f"global_step_{s}"
    assert f"SIGUSR1 received: stopped after step {s}, checkpoint {step_dir}; exiting with 75" in job.text(0)
    assert verify(str(step_dir)) is None and "Traceback" not in job.text(0) + job.text(1)
    total = [f"trainer.total_steps={s + 2}", "trainer.val_every=0"]
    proc = run_stage(stage, out, total)  # one rank, trainer.resume=auto
    assert f"global_step_{s} (step {s})" in proc.stderr
    assert sorted(rows(out)) == list(range(s + 3))
    run_stage(stage, tmp_path / "one", total)
    assert_same_run(tmp_path / "one", out, stage, steps=range(1, s + 3), exact=False)
    if stage != "sft":
        assert rows(out)[1][f"{stage}/units"] == 8.0  # pairs per step, summed over ranks
