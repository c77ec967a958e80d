"""The same short job under every launcher, 2 ranks on CPU (gloo): torchrun, the deepspeed launcher,
accelerate launch (DeepSpeed plugin), the Slurm srun body (slurm/task.sh with emulated SLURM_* variables)
and the Slurm+deepspeed node body (slurm/deepspeed_node.sh, hostfile, --no_ssh). Each must finish with
the right rank and world size on both ranks, only rank 0 writing the run files, and all must produce the
same metrics for the same seed. The real-model configs run 1-2 steps on a tiny Qwen2 of the same
architecture (tied embeddings, like Qwen2.5-0.5B).

All jobs start at once (module fixture) and are awaited together: most of each job's time is start-up
(imports, DeepSpeed's comm set-up, rendezvous), which overlaps well even on 2 cores.
"""
import glob
import os
import subprocess
import sys
import time

import pytest

from launch_testutil import (CPU_ACCELERATE, FAST, GPU_CONFIG, ROOT, base_env, dump, free_port, read_metrics,
                             step_metrics, tiny_qwen_dir)

pytestmark = pytest.mark.slow  # real training runs / several processes

BIN = os.path.dirname(sys.executable)
TRAIN = os.path.join(ROOT, "launch", "train.py")
CONFIG = os.path.join(ROOT, "configs", "default.yaml")
TIMEOUT = 420
LAUNCHERS = ["torchrun", "deepspeed", "accelerate", "slurm", "slurm_deepspeed"]


def job(out) -> list[str]:
    return ["--config", CONFIG, f"trainer.output_dir={out}", *FAST, "trainer.export=none"]


def _commands(tmp) -> dict:
    """name -> list of (argv, extra env) for each process that name starts."""
    cmds = {}
    out = {name: str(tmp / name) for name in LAUNCHERS}
    cmds["torchrun"] = [([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                          f"--master_port={free_port()}", TRAIN, *job(out["torchrun"])], {})]
    cmds["deepspeed"] = [([os.path.join(BIN, "deepspeed"), "--num_gpus", "2", "--master_port", str(free_port()),
                           TRAIN, *job(out["deepspeed"])], {})]
    cmds["accelerate"] = [([os.path.join(BIN, "accelerate"), "launch", "--config_file", CPU_ACCELERATE,
                            "--main_process_port", str(free_port()), TRAIN, *job(out["accelerate"])], {})]
    # what srun starts per task in slurm/train.sbatch: slurm/task.sh, rank from SLURM_* only
    port = free_port()
    common = dict(SLURM_NTASKS="2", SLURM_NODELIST="localhost", SLURM_JOB_ID="4321", MASTER_PORT=str(port),
                  REPO_DIR=ROOT, CONFIG="configs/default.yaml", OUTPUT_DIR=out["slurm"], PYTHON=sys.executable)
    cmds["slurm"] = [([os.path.join(ROOT, "slurm", "task.sh"), *FAST, "trainer.export=none"],
                      dict(common, SLURM_PROCID=str(r), SLURM_LOCALID=str(r))) for r in range(2)]
    # what srun starts per node in slurm/train_deepspeed.sbatch: one node of 2 slots
    hostfile = tmp / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmds["slurm_deepspeed"] = [([os.path.join(ROOT, "slurm", "deepspeed_node.sh"), *FAST, "trainer.export=none"],
                                dict(SLURM_NODEID="0", HOSTFILE=str(hostfile), MASTER_ADDR="127.0.0.1",
                                     MASTER_PORT=str(free_port()), REPO_DIR=ROOT, CONFIG="configs/default.yaml",
                                     OUTPUT_DIR=out["slurm_deepspeed"]))]
    return cmds, out


def _gpu_config_commands(tmp) -> dict:
    """The real-model configs on a tiny Qwen2 of the same architecture, CPU: the 0.5B config in fp32 for
    2 steps; the ZeRO-2 and ZeRO-3-offload variants as shipped (bf16) for 1 step without validation."""
    model = tiny_qwen_dir(tmp / "tiny-qwen2")
    small = ["trainer.device=cpu", f"model.path={model}", "rollout.batch_size=4", "actor.mini_batch_size=4",
             "actor.micro_batch_size=2", "rollout.max_new_tokens=8", "data.max_prompt_length=48",
             "trainer.loggers=[]"]
    runs = {}
    for name, config, extra in [
            ("gpu_config", GPU_CONFIG, ["model.dtype=fp32", "trainer.total_steps=2"]),
            ("zero2", os.path.join(ROOT, "configs", "zero2.yaml"), ["trainer.total_steps=1", "data.val_files=null",
                                                                    "trainer.export=none"]),
            ("zero3_offload", os.path.join(ROOT, "configs", "zero3_offload.yaml"),
             ["trainer.total_steps=1", "data.val_files=null", "trainer.export=none"])]:
        out = str(tmp / name)
        runs[name] = ([sys.executable, TRAIN, "--config", config, *small, f"trainer.output_dir={out}", *extra], out)
    return runs


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("launchers")
    cmds, outs = _commands(tmp)
    for name, (argv, out) in _gpu_config_commands(tmp).items():
        cmds[name], outs[name] = [(argv, {})], out
    procs = {name: [subprocess.Popen(argv, cwd=ROOT, env=base_env(**extra), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
                    for argv, extra in plist] for name, plist in cmds.items()}
    results = {}
    deadline = time.time() + TIMEOUT
    try:
        for name, plist in procs.items():
            outputs, codes = [], []
            for p in plist:
                try:
                    out, _ = p.communicate(timeout=max(1, deadline - time.time()))
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    out, _ = p.communicate()
                    out += f"\n[test] killed after {TIMEOUT} s"
                outputs.append(out)
                codes.append(p.returncode)
            results[name] = {"codes": codes, "output": "\n".join(outputs), "dir": outs[name]}
    finally:
        for plist in procs.values():
            for p in plist:
                if p.poll() is None:
                    os.killpg(p.pid, 9)
    return results


def _ok(res):
    assert all(c == 0 for c in res["codes"]), f"exit codes {res['codes']}:\n{res['output'][-8000:]}"


@pytest.mark.parametrize("name,launcher", [("torchrun", "torchrun"), ("deepspeed", "deepspeed"),
                                           ("accelerate", "accelerate"), ("slurm", "slurm"),
                                           ("slurm_deepspeed", "deepspeed")])
def test_launcher_runs_two_ranks_and_rank0_alone_writes(runs, name, launcher):
    res = runs[name]
    _ok(res)
    # rank 0 alone prints the banner; it names the launcher detected and the world size
    banners = [l for l in res["output"].splitlines() if l.startswith("verl_ds: launcher=")]
    assert len(banners) == 1 and banners[0].startswith(f"verl_ds: launcher={launcher} world_size=2 "), banners
    # both ranks took part under their own rank: one RNG state and one ZeRO shard per rank, ranks 0 and 1
    step_dir = os.path.join(res["dir"], "checkpoints", "global_step_2")
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(step_dir, "rng_rank*.json"))) == \
        ["rng_rank0.json", "rng_rank1.json"]
    shards = sorted(os.path.basename(p) for p in glob.glob(os.path.join(step_dir, "actor", "state", "*model_states.pt")))
    assert shards == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_model_states.pt"]
    # one metrics line per step: a second writer would duplicate them
    steps = [m["step"] for m in read_metrics(res["dir"])]
    assert len(steps) == len(set(steps)) and [s for s in steps if s > 0] == [1, 2], steps


def test_every_launcher_produces_the_same_metrics(runs):
    for name in LAUNCHERS:
        _ok(runs[name])
    reference = step_metrics(runs["torchrun"]["dir"])
    assert len(reference) == 2
    for name in LAUNCHERS[1:]:
        got = step_metrics(runs[name]["dir"])
        assert got == reference, f"{name} differs from torchrun:\n{dump(got)}\nvs\n{dump(reference)}"


def test_gpu_config_code_path_on_a_tiny_qwen2(runs):
    """configs/qwen2.5-0.5b-gsm8k.yaml as shipped, but model.path -> a tiny Qwen2 with tied embeddings,
    fp32 and CPU: the HF-directory model and tokenizer, chat template, GSM8K JSONL, exact_match."""
    res = runs["gpu_config"]
    _ok(res)
    assert "verl_ds: launcher=python world_size=1" in res["output"]
    metrics = read_metrics(res["dir"])
    steps = [m for m in metrics if "rollout/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in metrics:
        for k, v in m.items():
            assert v == v, f"NaN in {k} at step {m['step']}"  # noqa: PLR0124
    assert all(0.0 <= m["rollout/score/mean"] <= 1.0 for m in steps)  # exact_match is 0 or 1 per sample
    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(os.path.join(res["dir"], "hf_actor"))
    assert type(exported).__name__ == "Qwen2ForCausalLM"
    assert exported.get_output_embeddings().weight.data_ptr() == exported.get_input_embeddings().weight.data_ptr()


@pytest.mark.parametrize("name", ["zero2", "zero3_offload"])
def test_zero2_and_offload_configs_run_as_shipped_in_bf16(runs, name):
    """bf16 and the configs' ZeRO settings as shipped (only model.path and the device changed): ZeRO-2, and
    ZeRO-3 with optimizer and parameter offload plus the configs/deepspeed overlay."""
    res = runs[name]
    _ok(res)
    steps = [m for m in read_metrics(res["dir"]) if "rollout/score/mean" in m]
    assert [m["step"] for m in steps] == [1]
    assert all(v == v for v in steps[0].values())  # noqa: PLR0124
