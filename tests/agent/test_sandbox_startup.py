"""A run that executes model-written code (the code_tests reward, an environment with the python tool) starts only
with a sandbox that holds: without bubblewrap it is refused at start-up naming what is missing and how to install
it, unless agent.allow_weak_sandbox accepts the weak one (then a warning is printed); the isolation in force is
printed once and the agent rollout's metrics count the sandbox runs per backend."""
import os

import pytest

from verl_ds.agent import sandbox
from verl_ds.agent.env import ToolEnvironment
from verl_ds.agent.tools import ToolSet, calc, python
from verl_ds.config import ConfigError, load_config
from verl_ds.run.startup import check_startup


class PythonToolEnv(ToolEnvironment):
    """A user environment whose model may run Python (the case the start-up check looks for)."""

    def __init__(self):
        super().__init__(ToolSet([python]))

    def reset(self, sample):
        return [{"role": "user", "content": "compute"}]

    def score(self, answer):
        return 0.0


@pytest.fixture
def no_bwrap(monkeypatch, tmp_path):
    """PATH without bwrap, and the cached probe and acceptance forgotten (restored afterwards)."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty_bin"))
    monkeypatch.setitem(sandbox._STATE, "probe", None)
    monkeypatch.setitem(sandbox._STATE, "weak_ok", False)


def _cfg(tmp_path, *overrides):
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "compute", "tests": "assert True"}\n')
    return load_config(None, [f"trainer.output_dir={tmp_path}/run", "trainer.device=cpu",
                              f"data.train_files={rows}", *overrides])


CODE_RUNS = [["reward.functions=[code_tests]"],
             ["agent.environment=test_sandbox_startup:PythonToolEnv", "reward.functions=[]"]]


@pytest.mark.parametrize("overrides", CODE_RUNS, ids=["code_tests", "python_tool"])
def test_without_bubblewrap_a_run_of_model_code_is_refused(no_bwrap, tmp_path, overrides):
    with pytest.raises(ConfigError) as e:
        check_startup(_cfg(tmp_path, *overrides))
    msg = str(e.value)
    assert "bubblewrap (bwrap) is not on PATH" in msg and "apt-get install bubblewrap" in msg, msg
    assert "agent.allow_weak_sandbox" in msg and overrides[0].split("=")[0] in msg, msg
    with pytest.raises(sandbox.SandboxUnavailable, match="apt-get install bubblewrap"):
        sandbox.run_python("print(1)")  # a call that the start-up check did not see is refused too


def test_the_weak_sandbox_runs_when_accepted_with_a_warning(no_bwrap, tmp_path, capsys):
    check_startup(_cfg(tmp_path, "reward.functions=[code_tests]", "agent.allow_weak_sandbox=true"))
    err = capsys.readouterr().err
    assert "WEAK sandbox" in err and "bubblewrap (bwrap) is not on PATH" in err, err
    r = sandbox.run_python("print(6 * 7)")
    assert r.ok and r.stdout == "42\n" and "namespaces" not in r.isolation, r
    assert sandbox.sandbox_in_force() == "weak"


def test_a_run_without_model_code_needs_no_sandbox(no_bwrap, tmp_path, capsys):
    check_startup(_cfg(tmp_path, "reward.functions=[exact_match]"))
    assert "sandbox" not in capsys.readouterr().err
    assert ToolSet([calc]).names == ["calc"]  # the built-in calc task's tool runs no code


@pytest.mark.skipif(not sandbox._probe()[0], reason=f"no bubblewrap sandbox here: {sandbox._probe()[1]}")
def test_with_bubblewrap_the_isolation_is_printed_once(tmp_path, capsys):
    check_startup(_cfg(tmp_path, "reward.functions=[code_tests]"), rank=0)
    check_startup(_cfg(tmp_path, "reward.functions=[code_tests]"), rank=1)
    err = capsys.readouterr().err
    assert err.count("verl_ds: sandbox for model-written code (reward.functions[0]=code_tests): bubblewrap "
                     "namespaces (user, pid, mount, net, ipc, uts)") == 1, err
    before = sandbox.call_counts().get("bwrap", 0)
    assert sandbox.run_python("print(1)").ok and sandbox.call_counts()["bwrap"] == before + 1


def test_a_bwrap_that_cannot_make_namespaces_is_named(monkeypatch, tmp_path):
    fake = tmp_path / "bin" / "bwrap"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setitem(sandbox._STATE, "probe", None)
    monkeypatch.setitem(sandbox._STATE, "weak_ok", False)
    with pytest.raises(sandbox.SandboxUnavailable, match="cannot make a sandbox here: bwrap: No permissions to "
                                                         "create new namespace"):
        sandbox.require_sandbox(False)


class CodeResetEnv(ToolEnvironment):
    """Runs a program in the sandbox at each reset, as an environment that executes code would."""

    def __init__(self):
        super().__init__(ToolSet([python]))

    def reset(self, sample):
        assert sandbox.run_python("print(1)").stdout == "1\n"
        return [{"role": "user", "content": "compute"}]

    def score(self, answer):
        return 0.0


@pytest.mark.skipif(not sandbox._probe()[0], reason=f"no bubblewrap sandbox here: {sandbox._probe()[1]}")
def test_the_agent_rollout_counts_its_sandbox_runs_per_backend():
    from types import SimpleNamespace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from chat_testutil import chat_tokenizer
    from verl_ds.agent.rollout import AgentSpec, agent_rollout
    from verl_ds.generation import HFRolloutEngine

    tok = chat_tokenizer("chatml")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)).eval()
    engine = HFRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             gather_params=False)
    spec = AgentSpec("test_sandbox_startup:CodeResetEnv")
    out = agent_rollout(spec, SimpleNamespace(rollout_engine=engine), tok, {"prompts": ["a", "b"], "extras": {}},
                        max_new_tokens=4)
    assert float(out.metrics["agent/sandbox_runs/bwrap"]) == 2  # one reset per trajectory
    assert float(out.metrics["agent/sandbox_runs/weak"]) == 0
