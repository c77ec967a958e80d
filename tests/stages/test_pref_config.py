"""The dpo section of the config: each key's range named on refusal, label smoothing refused with IPO (validate and
`verl-ds config`, exit 2), and the defaults matching the loss functions' TRL defaults."""
import subprocess
import sys

import pytest

from verl_ds.config import ConfigError, load_config, validate


@pytest.mark.parametrize("override, message", [
    ("dpo.beta=0", r"dpo.beta: 0.0 is out of range \(0.0, 1000.0\]"),
    ("dpo.loss=hinge", r"dpo.loss: 'hinge' is not one of \['sigmoid', 'ipo'\]"),
    ("dpo.label_smoothing=0.5", r"dpo.label_smoothing: 0.5 is out of range \[0.0, 0.5\)"),
    ("dpo.reference_free=1", r"dpo.reference_free: expected bool"),
    ("dpo.gamma=1", r"unknown config key 'dpo.gamma'"),
])
def test_dpo_keys_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_label_smoothing_with_ipo_is_refused_by_validate_and_the_cli():
    cfg = load_config(None, ["dpo.loss=ipo", "dpo.label_smoothing=0.1", "dpo.beta=0.5"])
    with pytest.raises(ConfigError, match=r"dpo.label_smoothing=0.1: label smoothing applies to the sigmoid loss"):
        validate(cfg)
    validate(load_config(None, ["dpo.loss=ipo", "dpo.beta=0.5"]))
    validate(load_config(None, ["dpo.label_smoothing=0.2", "dpo.reference_free=true"]))
    out = subprocess.run([sys.executable, "-m", "verl_ds.cli", "config", "dpo.loss=ipo", "dpo.label_smoothing=0.1"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "dpo.label_smoothing=0.1" in out.stderr


def test_defaults_are_trl_defaults():
    d = load_config(None, []).dpo
    assert (d.beta, d.loss, d.label_smoothing, d.reference_free) == (0.1, "sigmoid", 0.0, False)


def test_shipped_rm_and_dpo_configs_are_valid_jobs():
    import os

    from verl_ds.run.checks import check_stage_config
    from verl_ds.stages.gate import unread_keys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name, out in (("rm", "runs/rm"), ("dpo", "runs/dpo")):
        cfg = load_config(os.path.join(root, "configs", f"{name}.yaml"), [])
        check_stage_config(cfg, 1, f"{name}.max_completion_length")
        assert unread_keys(cfg, name) == {}  # no key of the RL job or of another stage
        assert cfg.trainer.output_dir == out and cfg.data.train_files is None  # the built-in pairs
    assert load_config(os.path.join(root, "configs", "dpo.yaml"), []).dpo.loss == "sigmoid"
