"""The start-up gate: each bad input makes `verl-ds train` (and launch/train.py) exit with status 2 and one line
naming the culprit, before torch.distributed or any model starts (the resolved config is printed after the gate,
so its absence shows nothing was built)."""
import json
import os
import subprocess
import sys

import pytest
import torch

from e2e_utils import ROOT, TRAIN, base_env
from verl_ds.cli import main
from verl_ds.config import TOKEN_ENV, ConfigError, load_config
from verl_ds.run.startup import check_startup

QUICK = ["trainer.total_steps=1", "trainer.loggers=[plot]"]  # bounded, should a case ever get past the gate


def _train(capsys, tmp_path, *args):
    """Run `verl-ds train` in this process; (exit status, the error lines, stdout)."""
    status = main(["train", *args, f"trainer.output_dir={tmp_path}/run", *QUICK])
    out, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return status, [line for line in err.splitlines() if line.startswith("verl_ds: error:")], out


def _refused(capsys, tmp_path, args, message):
    status, errors, out = _train(capsys, tmp_path, *args)
    assert status == 2 and len(errors) == 1, (status, errors)
    assert message in errors[0], errors[0]
    assert "resolved config" not in out  # printed only once the gate passed
    return errors[0]


@pytest.fixture
def files(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "twice.yaml").write_text("actor:\n  lr: 0.001\ntrainer:\n  seed: 1\nactor:\n  grad_clip: 1.0\n")
    (d / "deep.yaml").write_text("actor: " + "[" * 5000 + "]" * 5000 + "\n")
    (d / "prompts.yaml").write_text("- prompt: hello\n")
    (d / "not_a_dataset").mkdir()
    (d / "not_a_dataset" / "rows.jsonl").write_text('{"prompt": "hello"}\n')
    (d / "ds_not_json.json").write_text("{'stage': 3}")
    (d / "ds_list.json").write_text("[]")
    (d / "not_a_checkpoint").mkdir()
    (d / "global_step_3").mkdir()  # a save killed before its COMPLETE manifest
    (d / "global_step_3" / "trainer_state.json").write_text("{}")
    return d


def test_a_section_given_twice(capsys, tmp_path, files):
    _refused(capsys, tmp_path, ["--config", str(files / "twice.yaml")],
             f"config file '{files}/twice.yaml': duplicate key 'actor' (first at line 1) at line 5")


def test_a_directory_as_the_config_file(capsys, tmp_path, files):
    _refused(capsys, tmp_path, ["--config", str(files)], f"config file '{files}' is a directory; expected a file")


def test_a_5000_deep_yaml(capsys, tmp_path, files):
    _refused(capsys, tmp_path, ["--config", str(files / "deep.yaml")],
             f"config file '{files}/deep.yaml': nested deeper than 64 levels")


def test_an_unreadable_config_file(capsys, tmp_path, files):
    path = files / "secret.yaml"
    path.write_text("actor:\n  lr: 0.001\n")
    path.chmod(0)
    try:
        with open(path, "rb"):
            readable = True  # root reads it anyway
    except PermissionError:
        readable = False
    if not readable:
        _refused(capsys, tmp_path, ["--config", str(path)], f"config file '{path}' cannot be read: Permission denied")
    # unreadable even for root: the kernel refuses to read a process's memory at address 0
    _refused(capsys, tmp_path, ["--config", "/proc/self/mem"], "config file '/proc/self/mem' cannot be read: ")


@pytest.mark.parametrize("override, message", [
    ("actor.grad_clip=.nan", "actor.grad_clip: expected a finite float, got nan"),
    ("reward.model_weight=.inf", "reward.model_weight: expected a finite float, got inf"),
    ("algo.clip_ratio_c=.nan", "algo.clip_ratio_c: expected a finite float, got nan"),
    ("data.prompt_key=''", "data.prompt_key: must not be empty, got ''"),
    ("rollout.temperature=5e-324", "rollout.temperature: 5e-324 is out of range [0.01, 100.0]"),
    ("rollout.temperature=1e-38", "rollout.temperature: 1e-38 is out of range [0.01, 100.0]"),
])
def test_values_refused_at_load(capsys, tmp_path, override, message):
    _refused(capsys, tmp_path, [override], message)


def test_the_k1_estimator_in_the_loss(capsys, tmp_path):
    line = _refused(capsys, tmp_path, ["algo.kl_placement=loss", "algo.kl_kind=k1"], "algo.kl_kind: 'k1' in the loss")
    assert "regularises nothing" in line and "low_var_kl" in line and "k2" in line


@pytest.mark.parametrize("override, message", [
    ("data.train_files={in}/not_a_dataset", "data.train_files: '{in}/not_a_dataset' is a directory but not a data "
                                            "set saved with datasets' save_to_disk"),
    ("data.train_files={in}/prompts.yaml", "data.train_files: '{in}/prompts.yaml' has the unsupported extension "
                                           "'.yaml'; supported: .jsonl, .ndjson, .json, .parquet files"),
    ("data.val_files={in}/prompts.yaml", "data.val_files: '{in}/prompts.yaml' has the unsupported extension"),
    ("deepspeed.config_file={in}/ds_not_json.json", "deepspeed.config_file: '{in}/ds_not_json.json' is not valid "
                                                   "JSON: Expecting property name enclosed in double quotes"),
    ("deepspeed.config_file={in}/ds_list.json", "deepspeed.config_file: '{in}/ds_list.json' must hold a JSON object, "
                                               "got a JSON list"),
    ("trainer.resume={in}/not_a_checkpoint", "trainer.resume: '{in}/not_a_checkpoint' is not a checkpoint directory; "
                                             "expected a checkpoint directory global_step_<N>"),
    ("trainer.resume={in}/global_step_3", "trainer.resume: '{in}/global_step_3' is not a complete checkpoint (no "
                                          "COMPLETE manifest"),
])
def test_paths_refused_before_building(capsys, tmp_path, files, override, message):
    _refused(capsys, tmp_path, [override.replace("{in}", str(files))], message.replace("{in}", str(files)))


def test_a_server_reachable_from_other_machines_needs_a_token(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    line = _refused(capsys, tmp_path, ["server.enabled=true", "server.host=0.0.0.0"],
                    "server.host: '0.0.0.0' is reachable from other machines and no token is set")
    assert TOKEN_ENV in line
    # the same host passes the gate once a token comes from the environment (or the config)
    monkeypatch.setenv(TOKEN_ENV, "s3cret-token")
    check_startup(load_config(None, ["server.enabled=true", "server.host=0.0.0.0", f"trainer.output_dir={tmp_path}/a"]))
    monkeypatch.delenv(TOKEN_ENV)
    check_startup(load_config(None, ["server.enabled=true", "server.host=0.0.0.0", "server.token=abc",
                                     f"trainer.output_dir={tmp_path}/b"]))
    check_startup(load_config(None, ["server.enabled=true", "server.host=localhost", f"trainer.output_dir={tmp_path}/c"]))
    with pytest.raises(ConfigError, match=r"server.host: '::' is reachable"):
        check_startup(load_config(None, ["server.enabled=true", "server.host='::'", f"trainer.output_dir={tmp_path}/d"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda(capsys, tmp_path):
    line = _refused(capsys, tmp_path, ["trainer.device=cuda"], "trainer.device: 'cuda' but CUDA is not available")
    assert "trainer.device=auto or cpu" in line


def test_good_paths_pass_the_gate(tmp_path):
    """The counterparts: a datasets directory, a complete checkpoint, a JSON-object DeepSpeed file."""
    import datasets

    data_dir = tmp_path / "saved"
    datasets.Dataset.from_dict({"prompt": ["even : 1 2 =>", "odd : 3 =>"]}).save_to_disk(str(data_dir))
    dict_dir = tmp_path / "saved_dict"
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"prompt": ["a"]})}).save_to_disk(str(dict_dir))
    step = tmp_path / "checkpoints" / "global_step_4"
    step.mkdir(parents=True)
    (step / "trainer_state.json").write_text('{"global_step": 4}')
    # the manifest checkpoint.save writes last: file -> size (its digests are checked at load)
    (step / "COMPLETE").write_text(json.dumps({"files": {"trainer_state.json": 18}}))
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"overlap_comm": true}}')
    for extra in ([f"data.train_files={data_dir}"], [f"data.train_files={dict_dir}"], [f"trainer.resume={step}"],
                  [f"deepspeed.config_file={ds}"]):
        check_startup(load_config(None, [f"trainer.output_dir={tmp_path}/run", *extra]))


def test_launch_train_py_exits_2_with_one_line(tmp_path, files):
    """The same gate through the entry point every launcher runs."""
    for args, message in (
        (["--config", str(files / "twice.yaml")], "duplicate key 'actor'"),
        (["data.prompt_key=''"], "data.prompt_key: must not be empty"),
    ):
        proc = subprocess.run([sys.executable, TRAIN, *args, f"trainer.output_dir={tmp_path}/run"], cwd=ROOT,
                              env=base_env(), capture_output=True, text=True, timeout=300)
        errors = [line for line in proc.stderr.splitlines() if line.startswith("verl_ds: error:")]
        assert proc.returncode == 2 and len(errors) == 1 and message in errors[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr and "resolved config" not in proc.stdout
        assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
