"""POST /v1/models/reward over real HTTP: only shipped or declared rewards, models only from the configured
directory, no user code in the server, and the requests that used to be accepted and then kill the run."""
import logging
import os
import shutil

import pytest
from server_testutil import TOKEN, call, variant

from verl_ds.rewards import REWARD_FNS
from verl_ds.server import ControlServer

ROUTE = "/v1/models/reward"


def _server(parts, **kw):
    return ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, reward_swapper=parts["swapper"],
                         reward_model_dir=kw.pop("reward_model_dir", parts["rm_dir"]), **kw)


def test_requests_that_used_to_be_accepted_and_then_kill_the_run_are_400(server, parts, rm_in_dir):
    empty = os.path.join(parts["rm_dir"], "empty")
    os.makedirs(empty)
    cases = [
        (b'{"functions":[{"name":"parity","weight":1e309}]}',
         "request body is not valid JSON: number 1e309 overflows to infinity (JSON numbers must be finite)"),
        (b'{"function":"parity","model_path":"%s","model_weight":1e309}' % rm_in_dir.encode(),
         "request body is not valid JSON: number 1e309 overflows to infinity (JSON numbers must be finite)"),
        (b'{"functions":[{"name":"parity","per_token":"no"}]}',
         "reward swap: functions[0].per_token: expected true or false, got 'no'"),
        # issue 31 item 6: finite in float64, not in the float32 scores (then NonFiniteError mid-run)
        (b'{"functions":[{"name":"parity","weight":1e300}]}',
         "reward swap: functions[0].weight: 1e+300 is out of range [-1e+06, 1e+06] (weighted scores are float32)"),
        (b'{"functions":[{"name":"parity","weight":1e39}]}',
         "reward swap: functions[0].weight: 1e+39 is out of range [-1e+06, 1e+06] (weighted scores are float32)"),
        (b'{"function":"parity","model_path":"%s","model_weight":1e300}' % rm_in_dir.encode(),
         "reward swap: model_weight: 1e+300 is out of range [-1e+06, 1e+06] (weighted scores are float32)"),
        # issue 31 item 8: a shipped function returns one float per sample (then RewardFunctionError)
        (b'{"functions":[{"name":"parity","per_token":true}]}',
         "reward swap: functions[0].per_token: the shipped reward 'parity' scores whole sequences (one float per "
         "sample); per_token must be false"),
        (b'{"model_path":"%s"}' % empty.encode(),
         f"reward swap: model_path {empty!r} has no config.json; expected a checkpoint saved with save_pretrained, "
         "found an empty directory"),
        (b'{"function":"builtins:print"}',
         f"reward swap: function: 'builtins:print' is reward code that is not declared swappable; only the shipped "
         f"rewards {sorted(REWARD_FNS)} and server.swappable_rewards [] may be swapped in, and importing new code over "
         "HTTP is off (server.allow_reward_code=false)"),
    ]
    for raw, message in cases:
        a = call(server.url, "POST", ROUTE, raw=raw, token=TOKEN)
        assert a.status == 400 and a.json["error"].startswith(message), (raw, a)
    assert parts["swapper"].staged == []
    # the valid neighbour of each is staged, and a 202 body is strict JSON
    ok = call(server.url, "POST", ROUTE, {"function": "parity", "model_path": rm_in_dir, "model_weight": -1e6},
              token=TOKEN)
    assert ok.status == 202 and ok.json["staged"]["model_weight"] == -1e6
    assert b"Infinity" not in ok.raw and b"NaN" not in ok.raw


def test_swappable_rewards_are_staged_and_others_refused(parts, tmp_path):
    reward_file = tmp_path / "const.py"
    reward_file.write_text("def const(prompts, responses, batch):\n    return [0.5] * len(responses)\n")
    declared = f"{reward_file}:const"
    with _server(parts, swappable_rewards=[declared]) as srv:
        a = call(srv.url, "POST", ROUTE, {"function": declared}, token=TOKEN)
        assert a.status == 202, a
        assert a.json["staged"]["functions"] == [{"name": declared, "weight": 1.0, "per_token": False}]
        b = call(srv.url, "POST", ROUTE, {"function": f"{reward_file}:other"}, token=TOKEN)
        assert b.status == 400 and "is reward code that is not declared swappable" in b.json["error"]
        assert f"server.swappable_rewards [{declared!r}]" in b.json["error"]
    assert [s["functions"][0]["name"] for s in parts["swapper"].staged] == [declared]


def test_allow_reward_code_is_loud_and_still_runs_no_code_in_the_server(parts, tmp_path, caplog):
    marker = tmp_path / "RAN"
    reward_file = tmp_path / "loud.py"
    reward_file.write_text(f"open({str(marker)!r}, 'w').close()\n"
                           "def score(prompts, responses, batch):\n    return [1.0] * len(responses)\n")
    with caplog.at_level(logging.WARNING, logger="verl_ds.server"):
        with _server(parts, allow_reward_code=True) as srv:
            start_warnings = [r for r in caplog.records if "allow_reward_code=true" in r.getMessage()]
            assert len(start_warnings) == 1 and "arbitrary Python code" in start_warnings[0].getMessage()
            for _ in range(2):
                a = call(srv.url, "POST", ROUTE, {"function": f"{reward_file}:score"}, token=TOKEN)
                assert a.status == 202, a
            shipped = call(srv.url, "POST", ROUTE, {"function": "parity"}, token=TOKEN)
            assert shipped.status == 202
    uses = [r for r in caplog.records if "swapping in reward CODE" in r.getMessage()]
    assert len(uses) == 2 and all(r.levelno == logging.WARNING and str(reward_file) in r.getMessage() for r in uses)
    assert not marker.exists()  # checked from its source, never imported by the server


def test_model_swaps_need_a_reward_model_dir_and_a_compatible_checkpoint(parts, reward_ckpt):
    with _server(parts, reward_model_dir=None) as srv:
        a = call(srv.url, "POST", ROUTE, {"model_path": reward_ckpt}, token=TOKEN)
        assert a.status == 400 and a.json["error"].startswith("reward swap: model_path is refused: no reward model "
                                                              "directory is configured")
    good = shutil.copytree(reward_ckpt, os.path.join(parts["rm_dir"], "rm64"))
    two = variant(reward_ckpt, os.path.join(parts["rm_dir"], "rm2"), id2label={"0": "a", "1": "b"},
                  label2id={"a": 0, "b": 1})
    with _server(parts, policy_vocab_size=100) as srv:  # the tiny checkpoint has 64 tokens
        small = call(srv.url, "POST", ROUTE, {"model_path": good}, token=TOKEN)
        assert small.status == 400 and small.json["error"].endswith(
            "vocab_size 64 is smaller than the policy tokenizer's 100 tokens; the reward model must embed every token "
            "the policy can produce")
        labels = call(srv.url, "POST", ROUTE, {"model_path": two}, token=TOKEN)
        assert labels.status == 400 and "needs exactly 1 label (one score), config.json has 2" in labels.json["error"]
    with _server(parts, policy_vocab_size=64) as srv:
        ok = call(srv.url, "POST", ROUTE, {"model_path": good}, token=TOKEN)
        assert ok.status == 202 and ok.json["staged"]["model_path"] == os.path.realpath(good)
    assert len(parts["swapper"].staged) == 1


def test_a_swapper_refusal_is_400(parts):
    class Refusing:
        def stage_reward_swap(self, spec, client=""):
            raise ValueError("a reward swap is already staged for step 4")

    with ControlServer(parts["state"], parts["registry"], port=0, token=TOKEN, reward_swapper=Refusing()) as srv:
        a = call(srv.url, "POST", ROUTE, {"function": "parity"}, token=TOKEN)
        assert a.status == 400 and a.json["error"] == "a reward swap is already staged for step 4"


@pytest.mark.parametrize("kwargs,message", [
    ({"swappable_rewards": "parity"}, "swappable_rewards must be a list of reward specs"),
    ({"swappable_rewards": [""]}, "swappable_rewards must be a list of reward specs"),
    ({"allow_reward_code": "yes"}, "allow_reward_code must be a bool, got 'yes'"),
    ({"policy_vocab_size": 0}, "policy_vocab_size must be an int >= 1, got 0"),
])
def test_reward_option_errors(parts, kwargs, message):
    with pytest.raises((TypeError, ValueError), match=message):
        ControlServer(parts["state"], parts["registry"], **kwargs)


def test_reward_model_dir_must_exist(parts, tmp_path):
    with pytest.raises(ValueError, match=r"reward_model_dir '.*/missing' is not a directory"):
        ControlServer(parts["state"], parts["registry"], reward_model_dir=tmp_path / "missing")
