"""benchmarks/policy_losses.py without training: each loss's run is a valid config with its paper's clips, and the
lines and exit status follow the first and last 10% of each run's parity scores (``train`` replaced by a writer)."""
import json
import os

import pytest
from benchmark_scripts import load_benchmark

from verl_ds.algos.policy_losses import get_policy_loss
from verl_ds.config import load_config


@pytest.mark.parametrize("loss", ["vanilla", "gspo", "gmpo", "cispo", "sapo"])
def test_each_losss_run_is_a_valid_grpo_config(loss):
    bench = load_benchmark("policy_losses")
    cfg = load_config(overrides=[*bench.GRPO, f"algo.policy_loss={loss}", *bench.CLIPS[loss]])
    assert cfg.algo.adv_estimator == "grpo" and get_policy_loss(cfg.algo.policy_loss)
    if loss == "gspo":
        assert (cfg.algo.clip_ratio_low, cfg.algo.clip_ratio_high) == (3e-4, 4e-4)


def test_the_lines_and_the_exit_status(tmp_path, monkeypatch, capsys):
    bench = load_benchmark("policy_losses")
    calls = []

    def fake_train(out_dir, overrides, timeout_s):
        calls.append(os.path.basename(out_dir))
        os.makedirs(out_dir)
        rise = 0.1 if out_dir.endswith("gspo_seed1") else 0.5  # gspo's seed 1 learns too little
        scores = [0.3] * 2 + [0.5] * 16 + [0.3 + rise] * 2  # 20 steps: the first and last two are the 10%
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as fh:
            for step, s in enumerate(scores, 1):
                fh.write(json.dumps({"step": step, "reward/parity/mean": s}) + "\n")
        return 10.0

    monkeypatch.setattr(bench, "train", fake_train)
    assert bench.main(["--losses", "vanilla,gspo", "--seeds", "0,1", "--work-dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert calls == ["vanilla_seed0", "vanilla_seed1", "gspo_seed0", "gspo_seed1"]
    assert lines[0] == "policy_loss_seed loss=vanilla seed=0 score_first=0.300 score_last=0.800 seconds=10.0"
    assert lines[2] == "policy_loss loss=vanilla score_first=0.300 score_last=0.800 seconds=10.0 seeds=2 learns=True"
    assert lines[5] == "policy_loss loss=gspo score_first=0.300 score_last=0.600 seconds=10.0 seeds=2 learns=False"


def test_an_unknown_loss_is_refused_naming_the_known(capsys):
    with pytest.raises(SystemExit):
        load_benchmark("policy_losses").main(["--losses", "ppo2"])
    assert "unknown ppo2" in capsys.readouterr().err
