"""Reading configs strictly: duplicate keys at any depth, bounded nesting, unreadable files, non-finite floats,
empty strings and list items, each refused with a message naming the file or key."""
import dataclasses
import math
import os

import pytest

from verl_ds.config import ConfigError, iter_fields, load_config, parse_override
from verl_ds.config.fields import _f, base_type
from verl_ds.config.loader import MAX_DEPTH, _build, yaml_load

FLOAT_KEYS = [dotted for dotted, tp, _, _ in iter_fields() if base_type(tp) is float]


def _write(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_text(text) if isinstance(text, str) else path.write_bytes(text)
    return str(path)


@pytest.mark.parametrize("text, line, first", [
    ("actor:\n  lr: 0.1\nactor:\n  lr: 0.2\n", 3, 1),                                  # a section twice
    ("actor:\n  lr: 0.1\n  grad_clip: 1.0\n  lr: 0.2\n", 4, 2),                        # a key twice in a section
    ("reward:\n  functions:\n    - {name: parity, name: exact_match}\n", 3, 3),        # inside a list item
    ("trainer: {seed: 1, seed: 2}\n", 1, 1),                                          # flow style
])
def test_duplicate_keys_are_refused_at_any_depth(tmp_path, text, line, first):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"config file '{path}': duplicate key '\w+' \(first at line {first}\) "
                                          rf"at line {line}, column \d+; each key may appear once"):
        load_config(path)


def test_duplicate_keys_in_an_override_value():
    with pytest.raises(ConfigError, match=r"override 'reward.functions=\[\{name: a, name: b\}\]': duplicate key 'name' \(first at line 1\) at line 1, column 12"):
        parse_override("reward.functions=[{name: a, name: b}]")


def test_merge_keys_may_override_what_they_merge(tmp_path):
    path = _write(tmp_path, "critic: &opt\n  lr: 0.002\n  weight_decay: 0.1\nactor:\n  <<: *opt\n  lr: 0.003\n")
    cfg = load_config(path)
    assert cfg.actor.lr == 0.003 and cfg.actor.weight_decay == 0.1 and cfg.critic.lr == 0.002


def test_nesting_is_bounded():
    assert yaml_load("[" * MAX_DEPTH + "]" * MAX_DEPTH, "t") is not None  # MAX_DEPTH levels: read
    with pytest.raises(ConfigError, match=rf"t: nested deeper than {MAX_DEPTH} levels at line 1, column {MAX_DEPTH + 1}"):
        yaml_load("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), "t")
    with pytest.raises(ConfigError, match=r"override 'actor.lr=\[\[\[.*nested deeper than 64 levels"):
        parse_override("actor.lr=" + "[" * 5000)
    deep_block = "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "v\n"  # block style nests too
    with pytest.raises(ConfigError, match="nested deeper than 64 levels"):
        yaml_load(deep_block, "t")


def test_files_that_are_not_readable_yaml(tmp_path):
    with pytest.raises(ConfigError, match=rf"config file '{tmp_path}/bin.yaml' is not UTF-8 text \(byte 9\)"):
        load_config(_write(tmp_path, b"actor: {}\xff\xfe", "bin.yaml"))
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)  # reading it would block forever
    with pytest.raises(ConfigError, match=rf"config file '{fifo}' is not a regular file"):
        load_config(str(fifo))
    assert load_config(_write(tmp_path, "", "empty.yaml")) == load_config()  # an empty file: the defaults
    with pytest.raises(ConfigError, match=r"is not valid YAML: expected ',' or '\]', but got '<stream end>' at line 2, column 1$"):
        load_config(_write(tmp_path, "actor: [1, 2\n", "bad.yaml"))


def test_every_float_key_is_one():
    assert len(FLOAT_KEYS) >= 15 and "rollout.temperature" in FLOAT_KEYS and "algo.clip_ratio_c" in FLOAT_KEYS


@pytest.mark.parametrize("key", FLOAT_KEYS)
@pytest.mark.parametrize("value, shown", [(".nan", "nan"), (".inf", "inf"), ("-.inf", "-inf"), ("1e400", "inf")])
def test_no_float_key_accepts_nan_or_inf(key, value, shown):
    with pytest.raises(ConfigError, match=rf"^{key}: expected a finite float, got {shown}$"):
        load_config(None, [f"{key}={value}"])


def test_an_int_too_large_for_a_float():
    with pytest.raises(ConfigError, match=r"actor.lr: expected a finite float, got an int of 401 digits"):
        load_config(None, ["actor.lr=1" + "0" * 400])


def test_a_field_may_allow_non_finite_values_explicitly():
    @dataclasses.dataclass
    class Section:
        bound: float = _f(1.0, "may be inf", finite=False)
        strict: float = _f(1.0, "finite")

    assert _build(Section, {"bound": math.inf}, "s.").bound == math.inf
    assert math.isnan(_build(Section, {"bound": math.nan}, "s.").bound)
    with pytest.raises(ConfigError, match=r"s.strict: expected a finite float, got inf"):
        _build(Section, {"strict": math.inf}, "s.")


@pytest.mark.parametrize("override, message", [
    ("data.prompt_key=''", r"data.prompt_key: must not be empty, got ''"),
    ("data.prompt_key='   '", r"data.prompt_key: must not be empty, got '   '"),
    ("model.path=''", r"model.path: must not be empty, got ''"),
    ("trainer.output_dir=''", r"trainer.output_dir: must not be empty"),
    ("data.passthrough_keys=[answer, 3]", r"data.passthrough_keys\[1\]: expected str, got int 3"),
    ("data.passthrough_keys=['']", r"data.passthrough_keys\[0\]: must not be empty"),
    ("server.swappable_rewards=[[a]]", r"server.swappable_rewards\[0\]: expected str, got list \['a'\]"),
    ("trainer.checkpoint_digest=some", r"trainer.checkpoint_digest: 'some' is not one of \['edges', 'full'\]"),
    ("rollout.n=0", r"rollout.n: 0 is out of range \[1, inf\)"),
    ("actor.micro_batch_size=0", r"actor.micro_batch_size: 0 is out of range \[1, inf\)"),
    ("rollout.log_prob_micro_batch_size=0", r"rollout.log_prob_micro_batch_size: 0 is out of range \[1, inf\)"),
    ("server.allow_reward_code=yes please", r"server.allow_reward_code: expected bool \(true/false\), got str"),
    ("actor.lr..x=1", r"override key 'actor.lr..x': expected section.key"),
])
def test_strings_lists_and_new_keys_are_checked(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


@pytest.mark.parametrize("section, key, message", [
    ("data", "passthrough_keys", r"^data.passthrough_keys\[0\]: expected str, got list \['lol', 'lol', .*, \.\.\.\]$"),
    ("reward", "functions", r"^reward.functions\[0\]: expected a reward function name \(a non-empty string\) or a "
                            r"mapping, got \['lol', .*\.\.\.\]$"),
    ("trainer", "seed", r"^trainer.seed: expected int, got list \[\['lol', .*\.\.\.$"),
])
def test_a_billion_laughs_is_refused_without_expanding_it(tmp_path, section, key, message):
    """YAML aliases nest 9 lists of 9 nine levels deep: 9^9 = 387M strings if anything walked or printed them."""
    rows = ["&x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    rows += [f"&x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]" for i in range(1, 10)]
    path = _write(tmp_path, f"{section}:\n  {key}: [{', '.join(rows)}]\n")
    with pytest.raises(ConfigError, match=message) as info:
        from verl_ds.config import validate

        validate(load_config(path))
    assert len(str(info.value)) < 400
