"""Each supervised job's own keys: sft/rm/dpo.max_completion_length limit the completions (not the RL sampler's
rollout.max_new_tokens, which such a job refuses naming its key, exit 2), the RL job is unaffected, keys a job does
not read are warned about, and the gate checks the config as given without changing it."""
import copy
import json
import os
import subprocess
import sys

import pytest

from verl_ds.config import ConfigError, load_config
from verl_ds.run.startup import check_startup
from verl_ds.stages.gate import check_stage, unread_keys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
JOBS = ("sft", "rm", "dpo")


def _rows(tmp_path, rows) -> str:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_the_sft_key_limits_completions(tmp_path):
    from verl_ds.stages.sft import load_sft_data

    path = _rows(tmp_path, [{"prompt": f"even : {d} =>", "completion": " 2 4 6 8"} for d in (1, 3)])
    common = [f"data.train_files={path}", "actor.mini_batch_size=2", "actor.micro_batch_size=1"]
    cut = load_sft_data(load_config(None, [*common, "sft.max_completion_length=2"])).train
    assert [len(x["response_ids"]) for x in cut] == [2, 2] and cut.report() == {"truncated": 2}
    whole = load_sft_data(load_config(None, [*common, "sft.max_completion_length=16"])).train
    assert [len(x["response_ids"]) for x in whole] == [5, 5] and whole.report() == {}  # 4 words and EOS
    with pytest.raises(ConfigError, match="data.train_files: .*overlong 2"):
        load_sft_data(load_config(None, [*common, "sft.max_completion_length=2", "data.overlong=skip"]))


@pytest.mark.parametrize("job", ["rm", "dpo"])
def test_each_preference_job_reads_its_own_key(tmp_path, job):
    from verl_ds.stages.pairs import load_pair_data

    path = _rows(tmp_path, [{"prompt": "even : 1 =>", "chosen": "2 4 6 8", "rejected": "1"},
                            {"prompt": "odd : 2 =>", "chosen": "3", "rejected": "2"}])
    other = "dpo" if job == "rm" else "rm"
    common = [f"data.train_files={path}", "actor.mini_batch_size=1", "actor.micro_batch_size=1"]
    # a 5-token chosen completion (4 words and EOS) is over the job's limit of 4: that pair is skipped
    short = load_pair_data(load_config(None, [*common, f"{job}.max_completion_length=4",
                                              f"{other}.max_completion_length=64"]), job).train
    assert len(short) == 1 and short.report() == {"overlong": 1}
    assert len(load_pair_data(load_config(None, [*common, f"{other}.max_completion_length=4"]), job).train) == 2


@pytest.mark.parametrize("job", JOBS)
def test_a_stage_config_with_the_rl_limit_is_refused_naming_its_key(tmp_path, job, capsys):
    from verl_ds.cli import main

    assert main([job, "rollout.max_new_tokens=16", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert (f"rollout.max_new_tokens=16: rollout.max_new_tokens is the RL sampler's limit; the "
            f"{ {'sft': 'SFT', 'rm': 'reward-model', 'dpo': 'DPO'}[job]} job's completion limit is "
            f"{job}.max_completion_length (set {job}.max_completion_length=16 instead)") in err
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


def test_the_refusal_exits_2_through_the_command(tmp_path):
    out = subprocess.run([sys.executable, "-m", "verl_ds.cli", "sft", "rollout.max_new_tokens=16",
                          f"trainer.output_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert out.stderr.count("verl_ds: error:") == 1 and "sft.max_completion_length" in out.stderr


def test_the_rl_job_is_unaffected(tmp_path):
    cfg = load_config(None, ["rollout.max_new_tokens=16", "sft.max_completion_length=200",
                             f"trainer.output_dir={tmp_path / 'run'}"])
    check_startup(cfg)  # its limit is rollout.max_new_tokens; the stage keys are not its own
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: 300 exceeds this run's limit 224"):
        check_startup(load_config(None, ["rollout.max_new_tokens=300", f"trainer.output_dir={tmp_path / 'run'}"]))


@pytest.mark.parametrize("job", JOBS)
def test_the_completion_limit_must_fit_the_context(tmp_path, job):
    cfg = load_config(os.path.join(ROOT, "configs", f"{job}.yaml"),
                      [f"{job}.max_completion_length=241", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=rf"^{job}.max_completion_length=241 exceeds this run's limit 240 "
                                          r"\(model.config_overrides.max_position_embeddings=256 - "
                                          r"data.max_prompt_length=16"):
        check_stage(cfg, job=job)
    cfg = load_config(os.path.join(ROOT, "configs", f"{job}.yaml"),
                      [f"{job}.max_completion_length=240", f"trainer.output_dir={tmp_path / 'run'}"])
    check_stage(cfg, job=job)


@pytest.mark.parametrize("job", JOBS)
def test_the_gate_leaves_the_config_as_given_and_warns_of_unread_keys(tmp_path, job, capsys):
    other = "dpo" if job != "dpo" else "sft"
    cfg = load_config(os.path.join(ROOT, "configs", f"{job}.yaml"),
                      ["algo.kl_coef=0.5", "rollout.temperature=0.5", "critic.lr=1e-4", "server.enabled=true",
                       f"{other}.max_completion_length=4", f"trainer.output_dir={tmp_path / 'run'}"])
    before = copy.deepcopy(cfg)
    derived = check_stage(cfg, 1, 0, job=job)
    assert cfg == before
    assert (derived.world_size, derived.mini_batch_per_rank, derived.grad_accum) == (1, 32, 2)
    unread = ["rollout.temperature", "critic.lr", "algo.kl_coef", f"{other}.max_completion_length", "server.enabled"]
    assert sorted(unread_keys(cfg, job)) == sorted(unread)
    err = capsys.readouterr().err
    assert f"verl_ds: warning: verl-ds {job} does not read" in err and all(k in err for k in unread)
    check_stage(cfg, 1, 0, job=job)
    assert "warning" not in capsys.readouterr().err  # once per process: the CLI's gate and the job's run the same
    check_stage(cfg, 1, 1, job=job)
    assert capsys.readouterr().err == ""  # rank 0 only


def test_the_shipped_stage_configs_set_only_their_own_keys():
    for job in JOBS:
        cfg = load_config(os.path.join(ROOT, "configs", f"{job}.yaml"), [])
        assert unread_keys(cfg, job) == {}, job
        assert getattr(cfg, job).max_completion_length == 8  # what rollout.max_new_tokens gave them before
