"""The config against the registries (verl_ds.run.checks): a key that names a registry entry is loaded as a plain
string and refused when the run is built, with the message the loader gives a key with fixed choices."""
import pytest

from verl_ds.config import ConfigError, load_config
from verl_ds.config.schema import iter_fields
from verl_ds.run.checks import check_config
from verl_ds.resolved_config import registry_choices
from verl_ds.stages.gate import check_stage
from verl_ds.state import STATE_KEYS


@pytest.mark.parametrize("override, message", [
    ("algo.adv_estimator=grop", r"algo.adv_estimator: 'grop' is not one of \['gae', 'grpo', .*\]; did you mean 'grpo'"),
    ("algo.loss_agg_mode=token_mean", r"algo.loss_agg_mode: 'token_mean' is not one of \['auto', 'token-mean'.*"
                                      r"did you mean 'token-mean'"),
    ("algo.kl_kind=k4", r"algo.kl_kind: 'k4' is not one of \['auto', 'k1'"),
])
def test_a_registry_name_is_checked_when_the_run_is_built(override, message):
    cfg = load_config(None, [override])  # the config does not import the registries
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_a_stage_job_checks_the_registry_names_too(tmp_path):
    with pytest.raises(ConfigError, match=r"algo.kl_kind: 'k4' is not one of"):
        check_stage(load_config(None, ["algo.kl_kind=k4", f"trainer.output_dir={tmp_path}/run"]))


def test_the_registry_keys_are_config_strings_and_hot_choices():
    specs = {dotted: spec for dotted, _, spec, _ in iter_fields()}
    for dotted in registry_choices():
        assert specs[dotted].choices is None, dotted  # one home for the names: the registry
    assert STATE_KEYS["kl_kind"].choices == registry_choices()["algo.kl_kind"]  # what a hot update may set
