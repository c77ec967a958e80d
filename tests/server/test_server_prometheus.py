"""prometheus_text: names, values and the exposition format, checked line by line."""
import math

import torch

from verl_ds.server import prometheus_text
from verl_ds.state import STATE_KEYS


def samples(text: str) -> dict:
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_names_are_sanitised_and_prefixed():
    text = prometheus_text({"actor/pg_loss": 0.5, "timing_s/update_actor": 2, "response_length/clip-ratio": 0.25,
                            "step": 4}, {})
    assert samples(text) == {"verl_ds_actor_pg_loss": "0.5", "verl_ds_timing_s_update_actor": "2",
                             "verl_ds_response_length_clip_ratio": "0.25", "verl_ds_step": "4"}
    assert text.endswith("\n")
    lines = text.splitlines()
    i = lines.index("verl_ds_actor_pg_loss 0.5")
    assert lines[i - 2] == "# HELP verl_ds_actor_pg_loss training metric actor/pg_loss"
    assert lines[i - 1] == "# TYPE verl_ds_actor_pg_loss gauge"


def test_values_bool_nonfinite_scalars_and_skipped_kinds():
    text = prometheus_text({"a": True, "b": float("nan"), "c": math.inf, "d": -math.inf, "e": torch.tensor(1.5),
                            "f": "text", "g": None, "h": [1, 2], "i": torch.ones(2)}, {})
    assert samples(text) == {"verl_ds_a": "1", "verl_ds_b": "NaN", "verl_ds_c": "+Inf", "verl_ds_d": "-Inf",
                             "verl_ds_e": "1.5"}


def test_colliding_names_keep_the_first_key_in_sorted_order():
    assert samples(prometheus_text({"a_b": 2, "a/b": 1}, {})) == {"verl_ds_a_b": "1"}  # '/' sorts before '_'


def test_state_gauges_info_labels_and_version():
    state = {"kl_coef": 0.002, "top_k": 0, "use_kl_penalty": True, "best_reward": None, "kl_kind": "k1",
             "reward_name": 'say "hi"\\n'}
    text = prometheus_text({"step": 1}, state, state_version=7)
    got = samples(text)
    assert got["verl_ds_state_kl_coef"] == "0.002" and got["verl_ds_state_top_k"] == "0"
    assert got["verl_ds_state_use_kl_penalty"] == "1" and "verl_ds_state_best_reward" not in got
    assert got["verl_ds_shared_state_version"] == "7"
    assert got['verl_ds_state_info{kl_kind="k1",reward_name="say \\"hi\\"\\\\n"}'] == "1"
    help_text = STATE_KEYS["kl_coef"].description
    assert help_text and f"# HELP verl_ds_state_kl_coef SharedState kl_coef: {help_text}\n" in text
