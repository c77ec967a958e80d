"""reward_spec.check_reward_spec: the one validation of a reward swap. Pure: it reads files (config.json, reward
source) but never imports or runs reward code; every refusal names the field and what was found."""
import os
import sys

import pytest
from server_testutil import variant

from verl_ds.reward_spec import MAX_SWAP_FUNCTIONS, check_reward_spec, parse_reward_swap
from verl_ds.rewards import REWARD_FNS

HTTP = dict(allow_code=False, swappable=(), reward_model_dir=None, vocab_size=None)


def check(spec, **policy):
    return check_reward_spec(spec, **{**HTTP, **policy})


def fn(name, weight=1.0, per_token=False):
    return {"name": name, "weight": weight, "per_token": per_token}


# ---- functions ---------------------------------------------------------------------------------------------------
def test_shipped_names_are_normalised():
    assert check({"function": "parity"}) == {"functions": [fn("parity")], "model_path": None, "model_weight": None}
    out = check({"functions": [{"name": "parity", "weight": 2, "per_token": False}], "function": "exact_match"})
    assert out["functions"] == [fn("parity", 2.0), fn("exact_match")]  # the list first, then 'function'
    assert out["functions"][0]["weight"] == 2 and out["functions"][0]["per_token"] is False
    assert isinstance(out["functions"][0]["weight"], float)
    assert check(out) == out  # its own output passes unchanged (the trainer re-checks what the server staged)


@pytest.mark.parametrize("spec,message", [
    ([], "reward swap: expected a JSON object, got list"),
    ({}, "reward swap: give 'function', 'functions' or 'model_path'"),
    ({"functions": []}, "reward swap: give 'function', 'functions' or 'model_path'"),
    ({"function": "parity", "model": "x"}, "reward swap: unknown field(s) ['model']; expected function, functions, "
                                           "model_path, model_weight"),
    ({"functions": "parity"}, "reward swap: functions: expected a list, got str 'parity'"),
    ({"function": 3}, "reward swap: function: expected a reward name (a string), got 3"),
    ({"functions": [{"name": "parity", "wieght": 2}]},
     "reward swap: functions[0]: expected a name or {name, weight, per_token}, got {'name': 'parity', 'wieght': 2}"),
    ({"functions": [{"weight": 2}]}, "reward swap: functions[0]: expected a name or {name, weight, per_token}, got "
                                     "{'weight': 2}"),
    ({"function": " parity"}, "reward swap: function.name: expected a reward name without surrounding blanks"),
    ({"functions": [{"name": "parity", "weight": float("inf")}]},
     "reward swap: functions[0].weight: expected a finite number, got inf"),
    ({"functions": [{"name": "parity", "weight": float("nan")}]},
     "reward swap: functions[0].weight: expected a finite number, got nan"),
    ({"functions": [{"name": "parity", "weight": 10 ** 400}]},
     "reward swap: functions[0].weight: expected a finite number, got 1000"),
    ({"functions": [{"name": "parity", "weight": True}]},
     "reward swap: functions[0].weight: expected a number, got True"),
    ({"functions": [{"name": "parity", "weight": "1"}]},
     "reward swap: functions[0].weight: expected a number, got '1'"),
    ({"functions": [{"name": "parity", "per_token": "no"}]},
     "reward swap: functions[0].per_token: expected true or false, got 'no'"),
    ({"functions": [{"name": "parity", "per_token": 1}]},
     "reward swap: functions[0].per_token: expected true or false, got 1"),
    ({"functions": ["parity", "parity"]}, "reward swap: functions[1]: 'parity' would be registered as 'parity', like "
                                          "functions[0]; give each function a distinct name"),
    ({"functions": ["parity"] * (MAX_SWAP_FUNCTIONS + 1)},
     f"reward swap: {MAX_SWAP_FUNCTIONS + 1} functions; at most {MAX_SWAP_FUNCTIONS} are allowed"),
    ({"function": "parity", "model_weight": 0.5}, "reward swap: model_weight given without model_path"),
    # issue 31 item 6: finite in float64, but the float32 scores they multiply overflow (NonFiniteError mid-run)
    ({"functions": [{"name": "parity", "weight": 1e300}]},
     "reward swap: functions[0].weight: 1e+300 is out of range [-1e+06, 1e+06] (weighted scores are float32)"),
    ({"functions": [{"name": "parity", "weight": -1e39}]},
     "reward swap: functions[0].weight: -1e+39 is out of range [-1e+06, 1e+06] (weighted scores are float32)"),
    ({"function": "parity", "model_path": "/x", "model_weight": 1e300},
     "reward swap: model_weight: 1e+300 is out of range [-1e+06, 1e+06] (weighted scores are float32)"),
    # issue 31 item 8: the shipped functions return one float per sample (RewardFunctionError at the first step)
    ({"functions": [{"name": "exact_match", "per_token": True}]},
     "reward swap: functions[0].per_token: the shipped reward 'exact_match' scores whole sequences (one float per "
     "sample); per_token must be false"),
])
def test_bad_requests_are_refused_with_the_reason(spec, message):
    with pytest.raises(ValueError) as e:
        check(spec)
    assert str(e.value).startswith(message), str(e.value)


def test_unknown_name_lists_valid_names_and_close_matches():
    with pytest.raises(ValueError) as e:
        check({"function": "exact_mach"}, swappable=["pkg.mod:score"])
    msg = str(e.value)
    assert msg.startswith("reward swap: function: unknown reward function 'exact_mach'; valid names: [")
    assert "'exact_match'" in msg and "swappable ['pkg.mod:score']" in msg and "Did you mean 'exact_match'?" in msg


@pytest.mark.parametrize("name", ["builtins:print", "os:system", "/tmp/evil.py:run", "verl_ds.rewards:parity_reward"])
def test_code_is_refused_unless_declared_swappable_or_allowed(name):
    with pytest.raises(ValueError) as e:
        check({"function": name})
    assert str(e.value) == (
        f"reward swap: function: {name!r} is reward code that is not declared swappable; only the shipped rewards "
        f"{sorted(REWARD_FNS)} and server.swappable_rewards [] may be swapped in, and "
        "importing new code over HTTP is off (server.allow_reward_code=false)")


def test_swappable_specs_pass_by_exact_string_without_being_looked_at():
    spec = "no_such_pkg.rewards:score"  # the config loader imports swappable specs at start-up, not this check
    assert check({"function": spec}, swappable=[spec])["functions"] == [fn(spec)]
    with pytest.raises(ValueError, match="not declared swappable"):
        check({"function": spec + "2"}, swappable=[spec])


@pytest.fixture
def code_dir(tmp_path, monkeypatch):
    """A reward file and a package whose import would leave a marker (to prove nothing is imported)."""
    marker = tmp_path / "IMPORTED"
    (tmp_path / "rw.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "def score(prompts, responses, batch):\n    return [1.0] * len(responses)\n"
        "def two(prompts, responses):\n    return []\n"
        "async def later(prompts, responses, batch):\n    return []\n"
        "class Scorer:\n    pass\n"
        "def flexible(*args):\n    return []\n"
        "def kw_needed(prompts, responses, batch, *, scale):\n    return []\n"
        "alias = score\n")
    pkg = tmp_path / "evilpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').close()\nraise SystemExit('imported!')\n")
    (pkg / "scores.py").write_text("from math import fsum as total\ndef score(p, r, b, extra=None):\n    return []\n")
    (tmp_path / "broken.py").write_text("def score(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path, marker


@pytest.mark.parametrize("attr", ["score", "flexible", "alias"])
def test_allowed_code_is_checked_from_its_source_without_running_it(code_dir, attr):
    tmp, marker = code_dir
    name = f"{tmp / 'rw.py'}:{attr}"
    assert check({"function": name}, allow_code=True)["functions"] == [fn(name)]
    assert check({"function": "evilpkg.scores:score"}, allow_code=True)["functions"] == [fn("evilpkg.scores:score")]
    assert check({"function": "evilpkg.scores:total"}, allow_code=True)["functions"] == [fn("evilpkg.scores:total")]
    assert not marker.exists() and "evilpkg" not in sys.modules and "evilpkg.scores" not in sys.modules


@pytest.mark.parametrize("name,message", [
    ("{tmp}/rw.py:scor", "{tmp}/rw.py' defines no top-level 'scor'; did you mean 'score', 'Scorer'?"),
    ("{tmp}/rw.py:two", "'two' must accept (prompts, responses, batch)"),
    ("{tmp}/rw.py:kw_needed", "'kw_needed' must accept (prompts, responses, batch)"),
    ("{tmp}/rw.py:later", "'later' is an async function; rewards are called synchronously"),
    ("{tmp}/rw.py:Scorer", "'Scorer' is a class; expected a function returning the scores"),
    ("{tmp}/nope.py:score", "file '{tmp}/nope.py' does not exist"),
    ("{tmp}/broken.py:score", "{tmp}/broken.py' cannot be parsed: SyntaxError"),
    ("{tmp}/rw.py:1bad", "expected 'module.path:function' or '/path/file.py:function', got '{tmp}/rw.py:1bad'"),
    ("builtins:print", "module 'builtins' has no Python source file (built-in), so it cannot be checked"),
    ("json:loads", "'loads' must accept (prompts, responses, batch)"),
    ("no_such_module_xyz:f", "module 'no_such_module_xyz' not found"),
    ("evilpkg.nothere:f", "module 'evilpkg.nothere' not found"),
    ("evilpkg.scores.deeper:f", "'evilpkg.scores' is a module, not a package"),
    ("evil pkg:f", "'evil pkg' is not a module path"),
])
def test_allowed_code_that_cannot_work_is_refused(code_dir, name, message):
    tmp, marker = code_dir
    name, message = name.format(tmp=tmp), message.format(tmp=tmp)
    with pytest.raises(ValueError) as e:
        check({"function": name}, allow_code=True)
    assert str(e.value).startswith("reward swap: function: ") and message in str(e.value), str(e.value)
    assert not marker.exists()


def test_two_specs_with_the_same_function_name_collide(code_dir):
    tmp, _ = code_dir
    with pytest.raises(ValueError, match=r"functions\[1\]: '.*rw.py:score' would be registered as 'score', like "
                                         r"functions\[0\]"):
        check({"functions": ["evilpkg.scores:score", f"{tmp}/rw.py:score"]}, allow_code=True)
    with pytest.raises(ValueError, match="would be registered as 'reward_model', like the reward model's own metric"):
        check({"function": "pkg:reward_model"}, swappable=["pkg:reward_model"])


# ---- reward models -------------------------------------------------------------------------------------------------
def test_model_path_is_refused_without_a_reward_model_dir(reward_ckpt):
    with pytest.raises(ValueError) as e:
        check({"model_path": reward_ckpt})
    assert str(e.value) == ("reward swap: model_path is refused: no reward model directory is configured "
                            "(server.reward_model_dir), so reward models cannot be swapped in over HTTP")


def test_a_checkpoint_under_the_dir_is_accepted(tmp_path, reward_ckpt):
    root = tmp_path / "models"
    good = variant(reward_ckpt, str(root / "rm"))
    out = check({"model_path": good, "model_weight": 3, "function": "parity"}, reward_model_dir=str(root), vocab_size=64)
    assert out == {"functions": [fn("parity")], "model_path": os.path.realpath(good), "model_weight": 3.0}
    assert check({"model_path": str(root / "rm" / ".." / "rm")}, reward_model_dir=str(root))["model_path"] == \
        os.path.realpath(good)


def test_model_paths_outside_the_dir_are_refused(tmp_path, reward_ckpt):
    root = tmp_path / "models"
    root.mkdir()
    outside = variant(reward_ckpt, str(tmp_path / "elsewhere"))
    os.symlink(outside, root / "link")
    for path in (outside, str(root / ".." / "elsewhere"), str(root / "link"), "/"):
        with pytest.raises(ValueError) as e:
            check({"model_path": path}, reward_model_dir=str(root))
        assert str(e.value) == (f"reward swap: model_path {path!r} resolves to {os.path.realpath(path)!r}, outside the "
                                f"reward model directory {os.path.realpath(root)!r} (server.reward_model_dir)")


@pytest.mark.parametrize("make,message", [
    (lambda src, d: os.makedirs(d), "has no config.json; expected a checkpoint saved with save_pretrained, found an "
                                    "empty directory"),
    (lambda src, d: variant(src, d, architectures=["LlamaForCausalLM"]),
     "is not a sequence-classification checkpoint: config.json architectures is ['LlamaForCausalLM']; expected e.g. "
     "['LlamaForSequenceClassification']"),
    (lambda src, d: variant(src, d, drop=("architectures",)),
     "is not a sequence-classification checkpoint: config.json architectures is None"),
    (lambda src, d: variant(src, d, id2label={"0": "bad", "1": "good"}, label2id={"bad": 0, "good": 1}),
     "a reward model needs exactly 1 label (one score), config.json has 2"),
    (lambda src, d: variant(src, d, drop=("id2label", "label2id")),
     "a reward model needs exactly 1 label (one score), config.json has none declared (neither num_labels nor id2label)"),
    (lambda src, d: variant(src, d, num_labels=3), "a reward model needs exactly 1 label (one score), config.json has 3"),
    (lambda src, d: variant(src, d, vocab_size=50), "vocab_size 50 is smaller than the policy tokenizer's 64 tokens"),
    (lambda src, d: variant(src, d, drop=("vocab_size",)),
     "config.json declares no integer vocab_size (found None); cannot check it against the policy tokenizer's 64 tokens"),
    (lambda src, d: variant(src, d, weights=False), "has no weights: expected one of ['model.safetensors'"),
])
def test_checkpoints_that_would_fail_at_the_step_boundary_are_refused(tmp_path, reward_ckpt, make, message):
    root = tmp_path / "models"
    root.mkdir()
    path = str(root / "rm")
    make(reward_ckpt, path)
    with pytest.raises(ValueError) as e:
        check({"model_path": path}, reward_model_dir=str(root), vocab_size=64)
    assert str(e.value).startswith(f"reward swap: model_path {path!r}") and message in str(e.value), str(e.value)


def test_unreadable_config_and_missing_dir(tmp_path):
    root = tmp_path / "models"
    (root / "rm").mkdir(parents=True)
    (root / "rm" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json cannot be read as JSON: Expecting property name"):
        check({"model_path": str(root / "rm")}, reward_model_dir=str(root))
    with pytest.raises(ValueError, match=r"model_path '.*/models/gone' is not a local directory$"):
        check({"model_path": str(root / "gone")}, reward_model_dir=str(root))
    with pytest.raises(ValueError, match=r"model_path: expected a directory path, got 3"):
        check({"model_path": 3}, reward_model_dir=str(root))
    with pytest.raises(ValueError, match=r"model_weight: expected a finite number, got inf"):
        check({"model_path": str(root / "rm"), "model_weight": float("inf")}, reward_model_dir=str(root))


def test_parse_reward_swap_is_the_trusted_form(tmp_path, reward_ckpt, code_dir):
    """Config files and the trainer's swapper: code allowed (checked statically), any local model directory."""
    tmp, marker = code_dir
    spec = {"functions": [f"{tmp}/rw.py:score"], "model_path": reward_ckpt}
    out = parse_reward_swap(spec)
    assert out == {"functions": [fn(f"{tmp}/rw.py:score")], "model_path": os.path.realpath(reward_ckpt),
                   "model_weight": None}
    assert parse_reward_swap(out) == out and not marker.exists()
    with pytest.raises(ValueError, match="has no Python source file"):
        parse_reward_swap({"function": "builtins:print"})
