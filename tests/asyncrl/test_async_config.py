"""rollout.mode / max_staleness / stale_samples / is_mode at start-up: the asynchronous modes refuse, naming the key,
what would make the generation thread enter a collective; the keys are checked like any other."""
import pytest

from verl_ds.config import ConfigError, load_config
from verl_ds.run.startup import check_startup


@pytest.mark.parametrize("overrides, message", [
    (["rollout.mode=streaming", "rollout.gather_params=false"], r"rollout.mode=streaming generates in a thread .* "
                                                                r"rollout.gather_params=false"),
    (["rollout.mode=one_step_off", "algo.dynamic_sampling=true", "algo.adv_estimator=grpo", "rollout.n=2"],
     r"rollout.mode=one_step_off .*algo.dynamic_sampling=true .*use rollout.mode=sync"),
    (["rollout.mode=streaming", "rollout.engine=vllm"], r"rollout.engine=vllm \(use hf; vllm serves "
                                                        r"rollout.split_ranks with rollout.mode=one_step_off\)"),
    (["rollout.mode=one_step_off", "rollout.engine=vllm"], r"one_step_off generates in a thread .*rollout.engine=vllm"),
    (["rollout.mode=streaming", "rollout.split_ranks=1", "rollout.engine=vllm"], r"rollout.engine=vllm \(use hf"),
    (["rollout.split_ranks=1"], r"rollout.split_ranks=1 needs rollout.mode=one_step_off or streaming, got sync"),
    (["rollout.mode=async"], r"rollout.mode: 'async' is not one of \['sync', 'one_step_off', 'streaming'\]"),
    (["rollout.max_staleness=-1"], r"rollout.max_staleness: -1 is out of range \[0, 64\]"),
    (["rollout.stale_samples=keep"], r"rollout.stale_samples: 'keep' is not one of \['drop', 'regenerate'\]"),
    (["rollout.is_mode=clip"], r"rollout.is_mode: 'clip' is not one of \['truncate', 'token_truncate', .*'decoupled'\]"),
])
def test_bad_async_config_is_refused_naming_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_startup(load_config(None, [f"trainer.output_dir={tmp_path}/run", *overrides]), 1)


def test_a_good_async_config_passes(tmp_path):
    check_startup(load_config(None, [f"trainer.output_dir={tmp_path}/run", "rollout.mode=streaming",
                                     "rollout.max_staleness=2", "rollout.stale_samples=drop",
                                     "rollout.is_correction=true", "rollout.is_mode=decoupled"]), 2)


def test_vllm_is_accepted_for_split_one_step_off(tmp_path):
    """Generation ranks of their own make whole batches between weight syncs: vLLM may sample there. Here only the
    asynchronous check is under test: without vLLM installed, the engine's own check is what refuses."""
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}/run", "rollout.mode=one_step_off", "rollout.split_ranks=1",
                             "rollout.engine=vllm", "model.config_overrides.hidden_size=256",
                             "model.config_overrides.intermediate_size=512"])
    try:
        check_startup(cfg, 1)
    except ConfigError as exc:
        assert "generates in a thread" not in str(exc) and str(exc).startswith("rollout.engine=vllm: "), str(exc)
