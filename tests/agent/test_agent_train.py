"""The built-in tool task through the real trainer: a run resumed from its mid checkpoint repeats the uninterrupted
run's steps exactly (weights, sampling, episodes, agent metrics)."""
import os

import pytest
import torch

from e2e_utils import read_metrics, run_train

pytestmark = pytest.mark.slow  # real training runs

CONFIG = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "agent_calc.yaml")


def _config_overrides() -> list:
    """configs/agent_calc.yaml as key=value overrides (the test's own go after it)."""
    import json

    import yaml

    with open(CONFIG, encoding="utf-8") as fh:
        cfg = yaml.safe_load(fh)
    return [f"{section}.{key}={json.dumps(value) if isinstance(value, (list, dict)) else value}"
            for section, keys in cfg.items() for key, value in keys.items() if key != "output_dir"]


SHORT = [*_config_overrides(), "actor.sft_warmup_steps=40", "rollout.batch_size=4", "actor.mini_batch_size=16",
         "actor.micro_batch_size=16", "data.num_val_prompts=8", "trainer.val_every=0", "trainer.export=merged",
         "rollout.max_new_tokens=24"]  # the config file's model.config_overrides (hidden 128) replace FAST's


def _params(path):
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def test_calc_resume_is_exact(tmp_path):
    straight, split = str(tmp_path / "straight"), str(tmp_path / "split")
    run_train(straight, [*SHORT, "trainer.total_steps=4"], timeout=900)
    run_train(split, [*SHORT, "trainer.total_steps=2"], timeout=900)
    run_train(split, [*SHORT, "trainer.total_steps=4", "trainer.resume=auto"], timeout=900)
    a, b = _params(os.path.join(straight, "hf_actor")), _params(os.path.join(split, "hf_actor"))
    for k in a:
        assert torch.equal(a[k], b[k]), f"parameter {k} differs after resume"
    ma = [m for m in read_metrics(straight) if "agent/turns/mean" in m]
    mb = [m for m in read_metrics(split) if "agent/turns/mean" in m]
    assert [m["step"] for m in mb] == [1, 2, 3, 4]
    for x, y in zip(ma, mb):
        for k in x:
            if not k.startswith(("timing_s/", "perf/", "agent/env_seconds")):
                assert x[k] == y[k], f"metric {k} at step {x['step']}: {x[k]} vs {y[k]}"
    assert all(m["agent/retokenization_mismatches"] == 0 for m in ma)
    assert all(m["agent/turns/mean"] >= 1 for m in ma)  # (the tool-call rate rises: benchmarks/agent_learning.py)
