"""A corpus of bad configurations, each with the message it must give. Every one fails in the checks run before
anything is built (load_config -> run.startup.check_startup: check_config, then paths, reward code, run directory, ...;
then the prompt sets), naming the key. CORPUS runs those checks in this process; CLI_CORPUS runs each case
through the real entry point (launch/train.py, all cases in one process: cli_batch.py) and wants exit status 2
with one `verl_ds: error:` line."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from e2e_utils import ROOT, TRAIN, base_env
from verl_ds.config import ConfigError, load_config
from verl_ds.run.startup import check_startup

HERE = os.path.dirname(os.path.abspath(__file__))

# (overrides, world size, expected message); {tmp} is a directory holding the fixtures made below
CORPUS = [
    # unknown keys, wrong types, out of range
    (["actor.lrr=1"], 1, r"unknown config key 'actor.lrr'; did you mean 'lr'"),
    (["trainr.total_steps=1"], 1, r"unknown config key 'trainr'; did you mean 'trainer'"),
    (["actor.lr=abc"], 1, r"actor.lr: expected float, got str 'abc'"),
    (["actor.lr=0"], 1, r"actor.lr: 0.0 is out of range \(0.0, 1.0\]"),
    (["trainer.total_steps=2.5"], 1, r"trainer.total_steps: expected int, got float 2.5"),
    (["trainer.total_steps=0"], 1, r"trainer.total_steps: 0 is out of range \[1, inf\)"),
    (["trainer.max_bad_steps=0"], 1, r"trainer.max_bad_steps: 0 is out of range \[1, inf\)"),
    (["trainer.dist_timeout_s=0"], 1, r"trainer.dist_timeout_s: 0 is out of range \[1, 2592000\]"),
    (["trainer.loggers=progress_bar"], 1, r"trainer.loggers: expected list, got str 'progress_bar'"),
    (["model.dtype=fp16"], 1, r"model.dtype: 'fp16' is not one of \['fp32', 'bf16'\]"),
    (["algo.loss_agg_mode=token_mean"], 1, r"algo.loss_agg_mode: .*did you mean 'token-mean'"),
    (["deepspeed.zero_stage=4"], 1, r"deepspeed.zero_stage: 4 is out of range \[0, 3\]"),
    (["rollout.top_p=1.5"], 1, r"rollout.top_p: 1.5 is out of range \(0.0, 1.0\]"),
    (["rollout.temperature=0"], 1, r"rollout.temperature: 0.0 is out of range \[0.01, 100.0\]"),
    (["data.overlong=cut"], 1, r"data.overlong: 'cut' is not one of \['truncate', 'skip'\]"),
    (["trainer.device=tpu"], 1, r"trainer.device: 'tpu' is not one of \['auto', 'cpu', 'cuda'\]"),
    (["server.port=70000"], 1, r"server.port: 70000 is out of range \[0, 65535\]"),
    (["actor=3"], 1, r"actor: expected a mapping of keys, got 3"),
    (["reward.functions=parity"], 1, r"reward.functions: expected list, got str 'parity'"),
    (["model.path=3"], 1, r"model.path: expected str or null, got int 3"),
    (["actor.lr=5.0"], 1, r"actor.lr: 5.0 is out of range"),
    # issue 32: keys taken out of the package are refused by name, never ignored
    (["model.cpu_linear=torch"], 1, r"model.cpu_linear: this key was removed; oneDNN Linear layers .*delete the key"),
    (["deepspeed.grad_accumulation_fusion=false"], 1, r"deepspeed.grad_accumulation_fusion: this key was removed"),
    (["trainer.cpu_keep_freed_memory=true"], 1, r"trainer.cpu_keep_freed_memory: this key was removed; .*MALLOC_"),
    # batch arithmetic and cross-field rules
    (["rollout.batch_size=30", "actor.mini_batch_size=16"], 1, r"actor.mini_batch_size=16 must divide rollout.batch_size=30"),
    (["rollout.batch_size=33", "actor.mini_batch_size=11", "actor.micro_batch_size=11"], 2,
     r"rollout.batch_size=33 must be divisible by the world size 2"),
    (["rollout.batch_size=12", "actor.mini_batch_size=6", "actor.micro_batch_size=3"], 4,
     r"actor.mini_batch_size=6 must be divisible by the world size 4"),
    (["actor.micro_batch_size=3"], 1, r"actor.micro_batch_size=3 must divide the per-rank mini-batch"),
    (["algo.kl_kind=k4"], 1, r"algo.kl_kind: 'k4' is not one of \['auto', 'k1'"),
    # issue 30 item 13: a band KL controller started at 0 stays at 0 while the reference runs every step
    (["algo.kl_coef=0"], 1, r"algo.kl_coef: 0 with algo.kl_ctrl=band would stay 0 for the whole run .* or "
                            r"algo.kl_ctrl=fixed to train without a KL term and without a reference"),
    (["algo.kl_coef=0", "algo.kl_ctrl=ziegler"], 1, r"algo.kl_coef: 0 with algo.kl_ctrl=ziegler would stay 0"),
    (["algo.clip_ratio_c=0.5"], 1, r"algo.clip_ratio_c: 0.5 is out of range \(1.0, inf\)"),
    (["deepspeed.zero_stage=2", "deepspeed.offload=[param]"], 1, r"deepspeed.offload: param needs deepspeed.zero_stage=3"),
    (["model.config_overrides.hidden_size=63"], 1, r"model.config_overrides: hidden_size=63 must be divisible by num_attention_heads=4"),
    (["model.config_overrides.num_key_value_heads=3"], 1, r"model.config_overrides: num_attention_heads=4 must be divisible by num_key_value_heads=3"),
    (["data.max_prompt_length=250"], 1, r"rollout.max_new_tokens: 8 exceeds this run's limit 6 \(model.config_overrides.max_position_embeddings=256 - data.max_prompt_length=250"),
    (["reward.functions=[]"], 1, r"configure at least one of reward.functions or reward.model_path"),
    (["reward.functions=[{weight: 2}]"], 1, r"reward.functions\[0\]: expected a name or \{name, weight, per_token\}"),
    (["trainer.resume=/no/such/dir"], 1, r"trainer.resume: expected 'auto', 'none' or an existing checkpoint directory"),
    (["deepspeed.config_file=/no/such.json"], 1, r"deepspeed.config_file: '/no/such.json' does not exist"),
    (["deepspeed.config_file={tmp}/not_json.json"], 1, r"deepspeed.config_file: '.*/not_json.json' is not valid JSON: Expecting"),
    (["deepspeed.config_file={tmp}/list.json"], 1, r"deepspeed.config_file: '.*/list.json' must hold a JSON object, got a JSON list"),
    (["deepspeed.config_file={tmp}"], 1, r"deepspeed.config_file: '.*' is a directory; expected a file"),
    # paths, checked by run.startup.check_startup before anything is built
    (["model.path={tmp}/missing"], 1, r"model.path: '.*/missing' does not exist"),
    (["model.path={tmp}/file.txt"], 1, r"model.path: '.*/file.txt' is not a directory"),
    (["model.path={tmp}/empty"], 1, r"model.path: '.*/empty' has no model files \(looked for config.json\)"),
    (["model.path={tmp}/model_no_tokenizer"], 1,
     r"model.path: '.*/model_no_tokenizer' has no tokenizer files .*; point model.tokenizer_path at the tokenizer"),
    (["model.path={tmp}/model_no_tokenizer", "model.tokenizer_path={tmp}/empty"], 1,
     r"model.tokenizer_path: '.*/empty' has no tokenizer files"),
    (["model.critic_path={tmp}/missing"], 1, r"model.critic_path: '.*/missing' does not exist"),
    (["reward.model_path={tmp}/empty"], 1, r"reward.model_path: '.*/empty' has no model files"),
    (["data.train_files={tmp}/missing.jsonl"], 1, r"data.train_files: '.*/missing.jsonl' does not exist"),
    (["data.val_files={tmp}/missing.jsonl"], 1, r"data.val_files: '.*/missing.jsonl' does not exist"),
    (["reward.functions=[parityy]"], 1, r"reward.functions\[0\]: unknown reward function 'parityy'.*Did you mean 'parity'"),
    (["reward.functions=['no_such_module_xyz:fn']"], 1,
     r"reward.functions\[0\]: reward function 'no_such_module_xyz:fn': module 'no_such_module_xyz' not found"),
    (["reward.functions=['{tmp}/missing.py:fn']"], 1, r"reward.functions\[0\]: .*file '.*/missing.py' does not exist"),
    (["reward.functions=['{tmp}/rewards.py:nope']"], 1, r"reward.functions\[0\]: .*has no attribute 'nope'"),
    (["reward.functions=['{tmp}/rewards.py:two_args']"], 1,
     r"reward.functions\[0\]: reward function '.*two_args' must accept \(prompts, responses, batch\)"),
    (["reward.functions=[parity, {name: '{tmp}/broken.py:fn'}]"], 1,
     r"reward.functions\[1\]: .*executing '.*/broken.py' failed: SyntaxError"),
    (["trainer.output_dir={tmp}/file.txt/run"], 1, r"trainer.output_dir: cannot create '.*/file.txt/run'"),
]


@pytest.fixture(scope="module")
def fixtures_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("badcfg")
    (d / "empty").mkdir()
    (d / "model_no_tokenizer").mkdir()
    (d / "model_no_tokenizer" / "config.json").write_text('{"model_type": "llama"}')
    (d / "file.txt").write_text("not a directory")
    (d / "rewards.py").write_text("def two_args(prompts, responses):\n    return [0.0] * len(prompts)\n")
    (d / "broken.py").write_text("def fn(prompts, responses, batch)\n    return []\n")
    (d / "not_json.json").write_text("{zero_optimization: 3}")
    (d / "list.json").write_text("[1, 2]")
    (d / "ds_stage7.json").write_text('{"zero_optimization": {"stage": 7}}')
    (d / "ds_fp16.json").write_text('{"fp16": {"enabled": true}}')
    (d / "ds_bf16.json").write_text('{"bf16": {"enabled": true}}')
    (d / "ds_optimizer.json").write_text('{"optimizer": {"type": "Adam", "params": {"lr": 0.001}}}')
    (d / "ds_train_batch.json").write_text('{"train_batch_size": 3}')
    (d / "ds_zero_list.json").write_text('{"zero_optimization": [3]}')
    (d / "corrupt.parquet").write_bytes(b"PAR1" + bytes(range(256)) * 4)  # no footer
    (d / "no_prompt.jsonl").write_text('{"question": "odd : 1 =>"}\n{"text": "even : 2 =>"}\n')
    (d / "ten.jsonl").write_text("".join(f'{{"prompt": "odd : {i} =>", "target": "odd"}}\n' for i in range(10)))
    os.mkfifo(d / "fifo.jsonl")  # nothing ever writes to it: opening it for reading blocks
    return str(d)


def check_before_build(overrides, world=1):
    """What `verl-ds train` runs before it initialises torch.distributed or builds any model."""
    check_startup(load_config(None, overrides), world)


def test_the_corpus_is_large_enough():
    assert len(CORPUS) >= 30


@pytest.mark.parametrize("overrides, world, message", CORPUS, ids=[" ".join(c[0])[:60] for c in CORPUS])
def test_bad_config_fails_before_building_and_names_the_key(fixtures_dir, tmp_path, overrides, world, message):
    overrides = [o.replace("{tmp}", fixtures_dir) for o in overrides]
    if not any(o.startswith("trainer.output_dir=") for o in overrides):
        overrides.append(f"trainer.output_dir={tmp_path}/run")
    with pytest.raises(ConfigError, match=message):
        check_before_build(overrides, world)


def test_a_good_config_passes_the_same_checks(fixtures_dir, tmp_path):
    check_before_build([f"trainer.output_dir={tmp_path}/run", "reward.functions=[parity, exact_match]"])
    assert os.path.isdir(tmp_path / "run")


@pytest.mark.parametrize("text, message", [
    ("actor: [1, 2\n", r"is not valid YAML"),
    ("- 1\n- 2\n", r"expected a mapping at the top level, got list"),
    ("actor:\n  lr: 0.001\n  epochs: 2\n", r"unknown config key 'actor.epochs'; did you mean 'ppo_epochs'"),
])
def test_bad_config_files(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))
    with pytest.raises(ConfigError, match=r"config file '.*/nope.yaml' does not exist"):
        load_config(str(tmp_path / "nope.yaml"))


def test_the_command_line_reports_a_missing_model_before_starting_anything(tmp_path):
    proc = subprocess.run([sys.executable, TRAIN, f"trainer.output_dir={tmp_path}/run", "model.path=/no/such/model"],
                          cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "verl_ds: error: model.path: '/no/such/model' does not exist" in proc.stderr
    assert "deepspeed_shm_comm" not in proc.stdout + proc.stderr  # torch.distributed was never initialised


# Issue 31 item 16: (overrides, expected message), run through `python launch/train.py`. {tmp}: the fixtures above;
# {port}: a port this test process listens on.
CLI_CORPUS = [
    (["trainer.seed=-1"], r"trainer.seed: -1 is out of range \[0, 4294967295\]"),
    (["trainer.seed=18446744073709551616"], r"trainer.seed: 18446744073709551616 is out of range \[0, 4294967295\]"),
    (["model.init_seed=-1"], r"model.init_seed: -1 is out of range \[0, 4294967295\]"),
    (["model.config_overrides.hidden_size=1099511627776"], r"model.config_overrides.hidden_size: 1099511627776 is out of range \[1, 65536\]"),
    (["model.config_overrides.num_hidden_layers=100000"], r"model.config_overrides.num_hidden_layers: 100000 is out of range \[1, 1024\]"),
    (["model.config_overrides.hidden_size=65536", "model.config_overrides.num_hidden_layers=1024"],  # in range, but 1.3e13 parameters: 200 TiB to train
     r"model.config_overrides: hidden_size=65536, intermediate_size=128, num_hidden_layers=1024: the model built from config has "
     r"at least 1.32e\+13 parameters; training it on the CPU needs at least 16 bytes each .* more than this "
     r"machine's \d+ GiB of memory"),
    (["trainer.dist_timeout_s=1000000000000000"],
     r"trainer.dist_timeout_s: 1000000000000000 is out of range \[1, 2592000\]"),
    (["rollout.batch_size=128", "data.num_train_prompts=64"],
     r"rollout.batch_size=128 is larger than the prompt set \(data.num_train_prompts=64\)"),
    (["data.train_files={tmp}/ten.jsonl"],
     r"rollout.batch_size=32 is larger than the 10 usable prompts of data.train_files \(.*/ten.jsonl: kept 10 of 10"),
    (["data.train_files={tmp}/corrupt.parquet"],
     r"data.train_files: '.*/corrupt.parquet' is not a readable Parquet file \(ArrowInvalid"),
    (["data.train_files={tmp}/no_prompt.jsonl"],
     r"data.train_files: .*/no_prompt.jsonl: no usable prompts \(prompt_key='prompt'; fields of the first row: "
     r"\['question'\]\).*missing_prompt 2 \(line 1, line 2\)"),
    (["data.passthrough_keys=[input_ids]"],
     r"data.passthrough_keys: \['input_ids'\] name the tokenized prompt's own fields"),
    (["deepspeed.config_file={tmp}/ds_stage7.json"],
     r"deepspeed.config_file: '.*/ds_stage7.json': zero_optimization.stage must be 0, 1, 2 or 3, got 7"),
    (["deepspeed.config_file={tmp}/ds_zero_list.json"],
     r"deepspeed.config_file: '.*/ds_zero_list.json': zero_optimization must be a JSON object, got \[3\]"),
    (["deepspeed.config_file={tmp}/ds_fp16.json"],
     r"deepspeed.config_file: '.*/ds_fp16.json': fp16.enabled is not supported: the engines' precision comes from "
     r"model.dtype"),
    (["deepspeed.config_file={tmp}/ds_bf16.json"],
     r"deepspeed.config_file: '.*/ds_bf16.json': bf16 \{\"enabled\": true\} contradicts model.dtype"),
    (["deepspeed.config_file={tmp}/ds_optimizer.json"],
     r"deepspeed.config_file: '.*/ds_optimizer.json': drop the 'optimizer' section"),
    (["deepspeed.config_file={tmp}/ds_train_batch.json"],
     r"deepspeed.config_file: '.*/ds_train_batch.json': train_batch_size=3 conflicts with the value derived from "
     r"the job config \(32\)"),
    (["server.enabled=true", "server.port={port}"],
     r"server.port: {port} on 127.0.0.1 is already in use by pid {pid} \(.*\); expected a free port"),
    (["server.enabled=true", "server.host=no-such-host.invalid"],
     r"server.host: 'no-such-host.invalid' does not resolve to an address"),
    (["server.enabled=true", "server.host=192.0.2.1", "server.token=t0ken"],  # TEST-NET-1 (RFC 5737): not ours
     r"server.host: cannot bind 192.0.2.1:0 \(Cannot assign requested address\)"),
    (["data.train_files={tmp}/fifo.jsonl"], r"data.train_files: '.*/fifo.jsonl' is not a regular file"),
    (["data.num_train_prompts=1000000000"], r"data.num_train_prompts: 1000000000 is out of range \[1, 1048576\]"),
    (["actor.lr=0.001", "trainer.seed=3", "actor.lr=0.002"],
     r"actor.lr: given twice among the overrides \(overrides 1 and 3\); give each key once"),
    (["actor={lr: 0.001}", "actor.lr=0.002"], r"actor.lr: overlaps 'actor' among the overrides"),
    (["server.swappable_rewards=[builtins:print]"],
     r"server.swappable_rewards\[0\]: reward function 'builtins:print': 'print' is a built-in function, not a "
     r"reward function; expected a Python function .*fn\(prompts, responses, batch\)"),
    (["reward.functions=[collections:Counter]"],
     r"reward.functions\[0\]: reward function 'collections:Counter': 'Counter' is a class, not a reward function"),
]
CLI_TIMEOUT = 300  # the whole batch; each case is refused within a few seconds, a hang or a training run fails it


@pytest.fixture(scope="module")
def cli_results(fixtures_dir, tmp_path_factory):
    """index -> (exit status, stderr, seconds) of every CLI_CORPUS case: launch/train.py run once per case in one
    process (cli_batch.py), while this process listens on the port the busy-port case asks for."""
    out = tmp_path_factory.mktemp("cli_runs")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    cases = [[o.replace("{tmp}", fixtures_dir).replace("{port}", str(port)) for o in args]
             + [f"trainer.output_dir={out}/run{i}"] for i, (args, _) in enumerate(CLI_CORPUS)]
    (out / "cases.json").write_text(json.dumps(cases))
    try:
        proc = subprocess.run([sys.executable, os.path.join(HERE, "cli_batch.py"), TRAIN, str(out / "cases.json"),
                               str(out / "results.json")], cwd=ROOT, env=base_env(), capture_output=True, text=True,
                              timeout=CLI_TIMEOUT)
        assert proc.returncode == 0, proc.stderr[-3000:]
    except subprocess.TimeoutExpired:
        pass  # the cases done before the hang are in results.json; the others fail below
    finally:
        holder.close()
    done = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else []
    return {i: (r["code"], r["stderr"], r["seconds"]) for i, r in enumerate(done)}, port


@pytest.mark.parametrize("i", range(len(CLI_CORPUS)), ids=[" ".join(c[0])[:60] for c in CLI_CORPUS])
def test_bad_config_exits_2_through_the_entry_point_naming_the_key(cli_results, i):
    results, port = cli_results
    assert i in results, f"not reached within {CLI_TIMEOUT} s: an earlier case hung or trained"
    code, stderr, seconds = results[i]
    message = CLI_CORPUS[i][1].replace("{port}", str(port)).replace("{pid}", str(os.getpid()))
    assert code == 2, f"exit {code} after {seconds:.0f} s:\n{stderr[-3000:]}"
    errors = [line for line in stderr.splitlines() if line.startswith("verl_ds: error: ")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert re.search(message, errors[0]), errors[0]
    assert seconds < 60, f"refused only after {seconds:.0f} s"


def test_the_port_check_runs_on_rank_0_only(tmp_path):
    """Other ranks on the machine would race rank 0 for the port; only rank 0 serves."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        cfg = load_config(None, [f"trainer.output_dir={tmp_path}/run", "server.enabled=true",
                                 f"server.port={holder.getsockname()[1]}", "rollout.batch_size=32"])
        check_startup(cfg, 2, rank=1)
        with pytest.raises(ConfigError, match=r"server.port: .* is already in use"):
            check_startup(cfg, 2, rank=0)
