"""The README's third command, ``make pipeline`` (SFT -> reward model -> PPO on it, and DPO), in a short form that
the suite can afford (two steps a job, a few hundred pairs): every job starts from the SFT export and runs to its
end. A job that the start-up gate refuses after the first one ran (torch.distributed up, in the same process) ends
the pipeline as the ``verl-ds`` commands do: one ``verl_ds: error:`` line and exit 2, not a traceback."""
import os
import re
import shutil
import subprocess

import pytest

from e2e_utils import ROOT, base_env

pytestmark = [pytest.mark.slow, pytest.mark.skipif(shutil.which("make") is None, reason="needs make (README)")]

SHORT = ["--sft-steps", "2", "--rm-steps", "2", "--ppo-steps", "2", "--dpo-steps", "2", "--pairs", "128",
         "--val-pairs", "64", "--eval-prompts", "16"]


def _make_pipeline(out: str, args: list, timeout: int = 900) -> subprocess.CompletedProcess:
    flags = " ".join([*args, "--output-dir", out])
    env = base_env()
    env.pop("OMP_NUM_THREADS")  # as a user's shell: the pipeline is one process
    for key in ("MAKELEVEL", "MAKEFLAGS", "MFLAGS"):  # under `make test` the inner make would say make[1]
        env.pop(key, None)
    return subprocess.run(["make", "-s", "pipeline", f"PIPELINE_ARGS={flags}"], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)


@pytest.mark.timeout(1000)
def test_make_pipeline_runs_every_job_to_its_end(tmp_path):
    out = str(tmp_path / "pipeline")
    proc = _make_pipeline(out, SHORT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"pipeline rm_accuracy=\d\.\d{3} ppo_rise=-?\d\.\d{3} dpo_rise=-?\d\.\d{3}", last), last
    for job in ("sft", "rm", "ppo", "dpo"):  # each ran in its own run directory, the later ones from the SFT export
        assert os.path.isfile(os.path.join(out, job, "config.yaml")), job
    assert "model.path=" + os.path.join(out, "sft", "hf_actor") in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]


@pytest.mark.timeout(600)
def test_a_job_refused_after_the_first_one_is_one_error_line_and_exit_2(tmp_path):
    # the reward model's job is refused at start-up (0 steps), after the SFT job started torch.distributed
    args = [*SHORT[:2], "--rm-steps", "0", "--pairs", "64", "--val-pairs", "32"]
    proc = _make_pipeline(str(tmp_path / "pipeline"), args)
    assert proc.returncode != 0
    assert "make: *** [Makefile" in proc.stderr and "Error 2" in proc.stderr  # the script's own status: 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("verl_ds: error:")]
    assert errors == ["verl_ds: error: trainer.total_steps: 0 is out of range [1, inf)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-6000:]
    assert "\n== rm: " in proc.stdout and "\n== ppo: " not in proc.stdout
