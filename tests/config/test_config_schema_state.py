"""One schema: SharedState's hot keys come from the config fields (same defaults, ranges, choices, help), hot
updates obey the same per-run limits as the config, and the KL estimator/placement rule holds on both paths."""
import json
import logging

import pytest

from verl_ds.config import Config, ConfigError, load_config, validate
from verl_ds.config.schema import iter_fields
from verl_ds.run.checks import check_config
from verl_ds.resolved_config import initial_state, kl_placement_of, run_limits
from verl_ds.state import HOT_KEYS, STATE_KEYS, SharedState, StateValidationError

# written out by hand from the task's defaults, not read from the code under test
EXPECTED_DEFAULTS = {
    "actor_lr": 1e-3, "critic_lr": 5e-3, "kl_coef": 0.01, "target_kl": 0.1, "kl_ctrl_type": "band",
    "use_kl_penalty": True, "kl_kind": "k1", "clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "cliprange_value": 0.5,
    "entropy_coef": 0.0, "gamma": 1.0, "lam": 0.95, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
    "max_new_tokens": 8, "max_staleness": 1,
}
EXPECTED_RANGES = {
    "actor_lr": "(0.0, 1.0]", "critic_lr": "(0.0, 1.0]", "kl_coef": "[0.0, 1000.0]", "target_kl": "(0.0, 1000.0]",
    "clip_ratio_low": "[0.0, 1.0)", "clip_ratio_high": "[0.0, 10.0]", "cliprange_value": "[0.0, 1000000.0]",
    "entropy_coef": "[0.0, 1.0]", "gamma": "[0.0, 1.0]", "lam": "[0.0, 1.0]", "temperature": "[0.01, 100.0]",
    "top_k": "[0, inf)", "top_p": "(0.0, 1.0]", "max_new_tokens": "[1, 1048576]", "max_staleness": "[0, 64]",
}


def _config_fields():
    return {dotted: (spec, f) for dotted, _, spec, f in iter_fields()}


def test_state_schema_matches_the_config_defaults_ranges_and_help():
    schema, cfg, fields = SharedState.schema(), Config(), _config_fields()
    assert set(HOT_KEYS) == set(EXPECTED_DEFAULTS) and len(HOT_KEYS) == 18
    for key in HOT_KEYS:
        entry = schema[key]
        assert entry["default"] == EXPECTED_DEFAULTS[key], key
        assert entry["range_text"] == EXPECTED_RANGES.get(key), key
        dotted = entry["config_key"]
        spec, _ = fields[dotted]
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if key != "kl_kind":  # the config's 'auto' is resolved before SharedState holds it
            assert entry["default"] == value and type(entry["default"]) is type(value), key
        assert entry["description"] == spec.help and entry["hot"], key
        assert entry["range"] == (None if spec.range_text() is None else [spec.lo, spec.hi]), key
    assert cfg.algo.kl_kind == "auto" and schema["kl_kind"]["default"] == "k1"
    assert schema["kl_ctrl_type"]["choices"] == ["fixed", "band", "ziegler"]
    assert "auto" not in schema["kl_kind"]["choices"] and {"k1", "low_var_kl", "k2", "k3"} <= set(schema["kl_kind"]["choices"])
    assert SharedState(rank=0).snapshot() == {**{k: d.default for k, d in STATE_KEYS.items()}, **initial_state(cfg)}
    json.dumps(schema)


@pytest.mark.parametrize("key", sorted(EXPECTED_RANGES))
def test_config_and_state_accept_and_refuse_the_same_values(key):
    """At and just beyond each bound, a config load and a hot update agree."""
    d = STATE_KEYS[key]
    dotted = d.schema()["config_key"]
    lo, hi = d.range
    probes = [v for b in (lo, hi) if b is not None for v in ((b - 1, b, b + 1) if d.type is int else
                                                             (b * (1 - 1e-9) - 1e-12, b, b * (1 + 1e-9) + 1e-12))]
    outcomes = set()
    for value in probes:
        try:
            load_config(None, [f"{dotted}={value!r}"])
            config_ok = True
        except ConfigError:
            config_ok = False
        try:
            SharedState(rank=0).stage({key: value})
            state_ok = True
        except StateValidationError:
            state_ok = False
        assert config_ok == state_ok, (key, value, config_ok, state_ok)
        outcomes.add(config_ok)
    assert outcomes == {True, False}, (key, probes)  # the probes straddle a bound


def test_temperatures_that_would_overflow_are_refused_on_both_paths():
    for tiny in (5e-324, 1e-38, 0.0099):
        with pytest.raises(ConfigError, match=rf"rollout.temperature: {tiny!r} is out of range \[0.01, 100.0\]"):
            load_config(None, [f"rollout.temperature={tiny!r}"])
        with pytest.raises(StateValidationError, match=rf"temperature: {tiny!r} is out of range \[0.01, 100.0\]"):
            SharedState(rank=0).stage({"temperature": tiny})
    assert SharedState(rank=0).stage({"temperature": 0.01})["staged"] == {"temperature": 0.01}
    assert "fp32/bf16" in STATE_KEYS["temperature"].description


def test_max_new_tokens_is_limited_by_the_built_in_models_context():
    cfg = load_config()  # 256 positions, prompts of up to 32 tokens: 224 tokens of room
    state = SharedState.from_config(cfg, rank=0)
    assert state.stage({"max_new_tokens": 224})["staged"] == {"max_new_tokens": 224}
    with pytest.raises(StateValidationError) as info:
        state.stage({"max_new_tokens": 1048576})
    assert info.value.errors["max_new_tokens"] == (
        "1048576 exceeds this run's limit 224 (model.config_overrides.max_position_embeddings=256 - data.max_prompt_length=32: "
        "prompt and response must fit the model's context)")
    with pytest.raises(StateValidationError, match="225 exceeds this run's limit 224"):
        state.update({"max_new_tokens": 225})  # the trainer's own writes too
    with pytest.raises(StateValidationError, match="300 exceeds this run's limit 224"):
        state.load_state_dict({"values": {"max_new_tokens": 300}, "version": 1})
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: 225 exceeds this run's limit 224"):
        check_config(load_config(None, ["rollout.max_new_tokens=225"]))
    assert SharedState(rank=0).stage({"max_new_tokens": 1048576})  # without limits only the static range applies


def test_max_new_tokens_is_limited_by_a_local_models_config_json(tmp_path):
    actor, critic = tmp_path / "actor", tmp_path / "critic"
    actor.mkdir()
    critic.mkdir()
    (actor / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 48}))
    (critic / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_positions": 40}))
    cfg = load_config(None, [f"model.path={actor}", "data.max_prompt_length=32"])
    assert run_limits(cfg).upper["max_new_tokens"].max == 16  # 48 - 32
    with pytest.raises(ConfigError, match=rf"rollout.max_new_tokens: 17 exceeds this run's limit 16 "
                                          rf"\(max_position_embeddings of model.path '{actor}'=48"):
        check_config(load_config(None, [f"model.path={actor}", "data.max_prompt_length=32", "rollout.max_new_tokens=17"]))
    state = SharedState.from_config(cfg, rank=0)
    with pytest.raises(StateValidationError, match=r"17 exceeds this run's limit 16"):
        state.stage({"max_new_tokens": 17})
    both = load_config(None, [f"model.path={actor}", f"model.critic_path={critic}", "data.max_prompt_length=32"])
    limit = run_limits(both).upper["max_new_tokens"]
    assert limit.max == 8 and f"n_positions of model.critic_path '{critic}'=40" in limit.why  # the smaller context


def test_kl_kind_auto_resolves_for_the_placement():
    in_reward, in_loss = load_config(), load_config(None, ["algo.kl_placement=loss"])
    assert initial_state(in_reward)["kl_kind"] == "k1" and initial_state(in_loss)["kl_kind"] == "low_var_kl"
    assert SharedState.from_config(in_loss, rank=0)["kl_kind"] == "low_var_kl"
    assert initial_state(load_config(None, ["algo.kl_placement=loss", "algo.kl_kind=k2"]))["kl_kind"] == "k2"


@pytest.mark.parametrize("estimator, n, placement", [("gae", 1, "reward"), ("grpo", 4, "loss"), ("dr_grpo", 4, "loss"),
                                                     ("rloo", 4, "reward"), ("reinforce_plus_plus", 1, "loss"),
                                                     ("reinforce_plus_plus_baseline", 4, "loss"),
                                                     ("remax", 1, "reward")])
def test_kl_placement_auto_follows_the_estimator(estimator, n, placement):
    cfg = load_config(None, [f"algo.adv_estimator={estimator}", f"rollout.n={n}"])
    assert cfg.algo.kl_placement == "auto"
    check_config(cfg)
    assert kl_placement_of(cfg) == placement
    assert initial_state(cfg)["kl_kind"] == ("low_var_kl" if placement == "loss" else "k1")
    assert run_limits(cfg).kl_placement == placement
    other = "reward" if placement == "loss" else "loss"  # an explicit placement wins
    assert kl_placement_of(load_config(None, [f"algo.adv_estimator={estimator}", f"rollout.n={n}",
                                              f"algo.kl_placement={other}"])) == other


def test_grpo_refuses_k1_with_its_auto_placement_in_the_loss():
    with pytest.raises(ConfigError, match=r"algo.kl_kind: 'k1' in the loss"):
        check_config(load_config(None, ["algo.adv_estimator=grpo", "rollout.n=4", "algo.kl_kind=k1"]))
    state = SharedState.from_config(load_config(None, ["algo.adv_estimator=grpo", "rollout.n=4"]), rank=0)
    with pytest.raises(StateValidationError):
        state.stage({"kl_kind": "k1"})


@pytest.mark.parametrize("kind", ["k1", "kl"])
def test_a_zero_gradient_estimator_in_the_loss_is_refused_in_config_and_hot_path(kind):
    with pytest.raises(ConfigError, match=rf"algo.kl_kind: '{kind}' in the loss .*regularises nothing.*low_var_kl"):
        check_config(load_config(None, ["algo.kl_placement=loss", f"algo.kl_kind={kind}"]))
    state = SharedState.from_config(load_config(None, ["algo.kl_placement=loss"]), rank=0)
    with pytest.raises(StateValidationError) as info:
        state.stage({"kl_kind": kind})
    assert "regularises nothing" in info.value.errors["kl_kind"] and state.staged() == []
    assert state.stage({"kl_kind": "k2"})["staged"] == {"kl_kind": "k2"}
    reward_state = SharedState.from_config(load_config(), rank=0)
    assert reward_state.stage({"kl_kind": kind})["staged"] == {"kl_kind": kind}  # fine in the reward


def test_kl_controller_names_old_names_refused():
    assert load_config().algo.kl_ctrl == "band"
    # the pre-0.x names (adaptive = ziegler, multiplicative = band) are gone: refused with the valid names
    for old in ("adaptive", "multiplicative"):
        with pytest.raises(ConfigError, match=rf"algo.kl_ctrl: '{old}' is not one of \['fixed', 'band', 'ziegler'\]"):
            load_config(None, [f"algo.kl_ctrl={old}"])
    with pytest.raises(StateValidationError, match=r"kl_ctrl_type.*'adaptive' is not one of"):
        SharedState(rank=0).stage({"kl_ctrl_type": "adaptive"})
    with pytest.raises(ConfigError, match=r"algo.kl_ctrl: 'pid' is not one of \['fixed', 'band', 'ziegler'\]"):
        load_config(None, ["algo.kl_ctrl=pid"])


@pytest.mark.parametrize("overrides, expected", [
    ([], True), (["algo.kl_coef=0", "algo.kl_ctrl=fixed"], False), (["algo.kl_coef=0"], True),
    (["algo.use_kl_penalty=false"], False),
])
def test_use_kl_penalty_is_the_effective_switch(overrides, expected):
    assert initial_state(load_config(None, overrides))["use_kl_penalty"] is expected


def test_zero_value_clip_range_means_no_clipping_everywhere():
    assert "0 means no value clipping" in STATE_KEYS["cliprange_value"].description
    assert SharedState(rank=0).stage({"cliprange_value": 0.0})["staged"] == {"cliprange_value": 0.0}
    assert load_config(None, ["critic.cliprange_value=0"]).critic.cliprange_value == 0.0


def test_batch_arithmetic_with_groups():
    cfg = load_config(None, ["rollout.batch_size=8", "rollout.n=4", "actor.mini_batch_size=16",
                             "actor.micro_batch_size=4"])
    d = validate(cfg, world_size=2)
    # 8 prompts x 4 = 32 samples; 2 optimizer steps of 16; 8 samples per rank per step, 2 micro-batches of 4
    assert (d.prompts_per_rank, d.samples_per_rank, d.mini_batches_per_epoch, d.mini_batch_per_rank) == (4, 16, 2, 8)
    assert d.grad_accum == 2


def test_new_keys_and_their_defaults():
    cfg = Config()
    assert (cfg.algo.adv_estimator, cfg.rollout.n, cfg.actor.micro_batch_size, cfg.rollout.log_prob_micro_batch_size) == (
        "gae", 1, 16, 64)
    assert (cfg.trainer.checkpoint_digest, cfg.server.swappable_rewards, cfg.server.allow_reward_code,
            cfg.server.reward_model_dir) == ("edges", [], False, None)


def test_state_limits_must_be_run_limits():
    with pytest.raises(TypeError, match=r"limits must be a RunLimits .* got dict"):
        SharedState(rank=0, limits={"max_new_tokens": 5})


def test_the_rollout_engine_names_are_the_registrys():
    """rollout.engine's allowed names are declared in the config (which never imports the engines); they must be
    exactly the engines registered in verl_ds.rollout_engines."""
    import typing

    from verl_ds.config.fields import choices_of
    from verl_ds.rollout_engines import ROLLOUT_ENGINES

    (tp, spec), = [(tp, spec) for dotted, tp, spec, _ in iter_fields() if dotted == "rollout.engine"]
    assert choices_of(tp, spec) == ROLLOUT_ENGINES.names() == typing.get_args(tp)
