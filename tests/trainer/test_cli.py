"""The verl-ds command: config, plan and error exits (no training)."""
import os

from verl_ds.cli import main


def test_config_prints_resolved_yaml(capsys):
    assert main(["config", "trainer.total_steps=7"]) == 0
    assert "total_steps: 7" in capsys.readouterr().out


def test_config_describe_lists_keys(capsys):
    assert main(["config", "--describe"]) == 0
    assert "`actor.lr`" in capsys.readouterr().out


def test_bad_override_exits_2_naming_the_key(capsys):
    assert main(["config", "actor.lrr=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'actor.lrr'" in err and "did you mean 'lr'" in err


def test_a_config_file_with_a_removed_key_exits_2_naming_it(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text("model:\n  cpu_linear: auto\n")  # a config written before issue 32
    assert main(["config", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "model.cpu_linear: this key was removed" in err and "delete the key" in err


def test_config_check_runs_the_start_up_checks(tmp_path, capsys):
    assert main(["config", "--check", f"trainer.output_dir={tmp_path}/run"]) == 0
    assert os.path.isdir(tmp_path / "run")  # the run directory is created (and known writable)
    capsys.readouterr()
    assert main(["config", "model.path=/no/such/model"]) == 0  # without --check: no machine checks
    capsys.readouterr()
    assert main(["config", "--check", "model.path=/no/such/model"]) == 2
    assert capsys.readouterr().err.strip() == "verl_ds: error: model.path: '/no/such/model' does not exist"


def test_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor:\n  lr: [1,\n")  # PyYAML's own message spans several lines
    assert main(["config", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"verl_ds: error: config file '{bad}' is not valid YAML")


def test_plan_prints_memory_batches_and_launch_commands(capsys):
    assert main(["plan", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    for needle in ("memory per GPU", "batch arithmetic", "torchrun", "deepspeed", "accelerate", "sbatch"):
        assert needle in out


def test_plan_refuses_inconsistent_batch_arithmetic(capsys):
    assert main(["plan", "--world-size", "3"]) == 2
    assert "divisible by the world size 3" in capsys.readouterr().err


def test_train_refuses_inconsistent_launch_env(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    assert main(["train", "trainer.total_steps=1"]) == 2
    assert "inconsistent launch environment" in capsys.readouterr().err


def test_state_without_a_server_fails_cleanly(tmp_path, capsys):
    assert main(["state", "--url", "http://127.0.0.1:9", "get"]) != 0
