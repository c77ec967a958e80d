"""Issue 31 item 6, config-file side: values finite in float64 that overflow float32 once the run uses them (reward
weights, weight decay, the overlong penalty) and a NaN in the DeepSpeed JSON used to be accepted and end the run
with NonFiniteError; item 8: per_token on a shipped (per-sequence) reward ended it with RewardFunctionError. The
start-up gate refuses each, naming the key, and the command exits 2."""
import subprocess
import sys

import pytest

from e2e_utils import FAST, ROOT, TRAIN, base_env, merged
from verl_ds.config import ConfigError, load_config
from verl_ds.run.startup import check_startup

CASES = [
    (["reward.functions=[{name: parity, weight: 1e300}]"],
     r"reward.functions\[0\].weight: 1e\+300 is out of range \[-1e\+06, 1e\+06\] \(weighted scores are float32\)"),
    (["reward.functions=[{name: parity, weight: -1e39}]"], r"reward.functions\[0\].weight: -1e\+39 is out of range"),
    (["reward.model_weight=1e300"], r"reward.model_weight: 1e\+300 is out of range \[-1000000.0, 1000000.0\]"),
    (["actor.weight_decay=1e308"], r"actor.weight_decay: 1e\+308 is out of range \[0.0, 1.0\]"),
    (["critic.weight_decay=1e308"], r"critic.weight_decay: 1e\+308 is out of range \[0.0, 1.0\]"),
    (["algo.overlong_penalty_factor=1e308"], r"algo.overlong_penalty_factor: 1e\+308 is out of range \[0.0, 1000000.0\]"),
    (["deepspeed.config_file={tmp}/nan_clip.json"],
     r"deepspeed.config_file: '.*/nan_clip.json': gradient_clipping is nan; expected a finite number"),
    (["deepspeed.config_file={tmp}/inf_nested.json"],
     r"deepspeed.config_file: '.*/inf_nested.json': zero_optimization.reduce_bucket_size is inf; expected a finite"),
    (["deepspeed.config_file={tmp}/neg_clip.json"],
     r"deepspeed.config_file: '.*/neg_clip.json': gradient_clipping is -1.0; expected a number >= 0"),
    (["reward.functions=[{name: parity, per_token: true}]"],
     r"reward.functions\[0\].per_token: the shipped reward 'parity' scores whole sequences"),
]


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fatalcfg")
    (d / "nan_clip.json").write_text('{"gradient_clipping": NaN}')  # Python's json reads it
    (d / "inf_nested.json").write_text('{"zero_optimization": {"reduce_bucket_size": Infinity}}')
    (d / "neg_clip.json").write_text('{"gradient_clipping": -1.0}')
    return str(d)


@pytest.mark.parametrize("overrides, message", CASES, ids=[c[0][0][:50] for c in CASES])
def test_values_that_overflow_float32_are_refused_before_anything_is_built(fixtures_dir, tmp_path, overrides, message):
    overrides = [o.replace("{tmp}", fixtures_dir) for o in overrides] + [f"trainer.output_dir={tmp_path}/run"]
    with pytest.raises(ConfigError, match=message):
        check_startup(load_config(None, overrides), 1)


def test_their_neighbours_in_range_pass(tmp_path):
    check_startup(load_config(None, [f"trainer.output_dir={tmp_path}/run", "actor.weight_decay=1.0",
                                     "reward.functions=[{name: parity, weight: -1e6}]", "reward.model_weight=1e6",
                                     "algo.overlong_penalty_factor=1e6"]), 1)


def test_the_command_exits_2_naming_the_key(tmp_path):
    proc = subprocess.run([sys.executable, TRAIN, *merged([f"trainer.output_dir={tmp_path}/run"], FAST,
                                                          ["trainer.total_steps=1", "trainer.export=none",
                                                           "actor.weight_decay=1e308"])],  # short, should it start at all
                          cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "verl_ds: error: actor.weight_decay: 1e+308 is out of range [0.0, 1.0]" in proc.stderr
