"""Real SFT runs (DeepSpeed ZeRO-3, tiny Llama, the built-in task's demonstrations): it learns the task (validation
loss near its floor, greedy decoding of the export follows the rule), a resumed run equals an uninterrupted one,
LoRA trains and exports, and one step on 2 ranks equals the same step on 1 rank."""
import json
import os
import sys

import pytest
import torch

from e2e_utils import base_env, free_port, merged, run_group

from verl_ds.config import load_config
from verl_ds.dist import detect_launch
from verl_ds.stages.sft import SFTJob
from verl_ds.tasks import parity

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SFT_CONFIG = os.path.join(ROOT, "configs", "sft.yaml")
PROBE = os.path.join(os.path.dirname(__file__), "sft_probe.py")
SMALL = ["model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64", "data.num_train_prompts=64", "data.num_val_prompts=8",
         "actor.mini_batch_size=8", "actor.micro_batch_size=4", "trainer.loggers=[plot]", "trainer.resume=auto"]


def fit(out, *overrides, config=None) -> dict:
    cfg = load_config(config, merged([f"trainer.output_dir={out}"], SMALL if config is None else [], overrides))
    return SFTJob(cfg, detect_launch({})).fit()


def rows(out) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as fh:
        return [json.loads(line) for line in fh]


def weights(export_dir) -> dict:
    from safetensors.torch import load_file

    return load_file(os.path.join(export_dir, "model.safetensors"))


def greedy_score(export_dir, n: int = 64) -> float:
    """The parity rule's mean score of greedy completions of held-out prompts by the exported model (plain HF)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(export_dir).eval()
    tok = AutoTokenizer.from_pretrained(export_dir)
    scores = []
    for record in parity.generate_prompts(n, seed=123):
        ids = tok(record["prompt"], return_tensors="pt")["input_ids"]
        out = model.generate(ids, max_new_tokens=parity.RESPONSE_LENGTH + 1, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        scores.append(parity.score(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), record["target"]))
    return sum(scores) / n


def test_sft_learns_the_builtin_task(tmp_path):
    """configs/sft.yaml, 30 steps: the held-out loss falls from ~2.9 (a near-uniform model over 18 tokens) to near
    its floor 6 ln(5) / 7 = 1.38 (6 digits drawn from 5, then a certain EOS), and greedy decoding follows the rule."""
    summary = fit(tmp_path / "run", "trainer.total_steps=30", "actor.lr=3e-3", "actor.micro_batch_size=32",
                  "data.num_train_prompts=1024", config=SFT_CONFIG)
    start, end = summary["val_start"]["val/loss"], summary["val_end"]["val/loss"]
    assert start > 2.5 and end < 1.6, (start, end)
    assert greedy_score(summary["export_dir"]) >= 0.9


def test_resume_equals_an_uninterrupted_run(tmp_path):
    """4 steps straight vs 2 steps, then a new job in the same directory to 4: the same metrics for steps 3-4 (the
    data order, optimizer and RNG come back) and the same exported weights, bit for bit."""
    straight = fit(tmp_path / "a", "trainer.total_steps=4", "trainer.val_every=1")
    first = fit(tmp_path / "b", "trainer.total_steps=2", "trainer.val_every=1")
    assert first["steps"] == 2
    at_two = weights(first["export_dir"])  # the same directory is exported again by the resumed job
    resumed = fit(tmp_path / "b", "trainer.total_steps=4", "trainer.val_every=1")
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]  # nothing logged twice
    drop = ("timing_s/step",)
    for x, y in zip(a, b):
        assert {k: v for k, v in x.items() if k not in drop} == {k: v for k, v in y.items() if k not in drop}
    wa, wb = weights(straight["export_dir"]), weights(resumed["export_dir"])
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not torch.equal(wa["lm_head.weight"], at_two["lm_head.weight"])  # steps 3-4 did train


def test_lora_trains_only_adapters_and_exports_a_plain_model(tmp_path):
    from transformers import AutoModelForCausalLM

    summary = fit(tmp_path / "run", "actor.lora_rank=4", "actor.lr=5e-3", "trainer.total_steps=6")
    losses = [r["sft/loss"] for r in rows(tmp_path / "run") if "sft/loss" in r]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert summary["val_end"]["val/loss"] < summary["val_start"]["val/loss"]
    model = AutoModelForCausalLM.from_pretrained(summary["export_dir"])  # merged: no peft needed to load it
    assert not any("lora" in name for name, _ in model.named_parameters())


def _probe(root, name: str, overrides: list, nproc: int = 1) -> dict:
    result = root / f"{name}.pt"
    args = [str(result), *merged([f"trainer.output_dir={root / name}"], SMALL, overrides)]
    cmd = [sys.executable, PROBE, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}",
         PROBE, *args]
    proc = run_group(cmd, env=base_env(), timeout=600)
    assert proc.returncode == 0, f"probe {name} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return torch.load(result)


def _same_update(a: dict, b: dict, rtol: float = 1e-5) -> None:
    da = torch.cat([a["actor"][k].flatten() for k in sorted(a["actor"])])
    db = torch.cat([b["actor"][k].flatten() for k in sorted(a["actor"])])
    assert float(da.norm()) > 0
    assert float((da - db).norm() / da.norm()) <= rtol
    for key in ("sft/loss", "actor/grad_norm", "sft/units"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5), key


@pytest.mark.slow
def test_two_ranks_and_other_micro_batches_give_the_one_rank_update(tmp_path):
    """The same 8 rows: 1 rank in one micro-batch; 2 ranks x 4 rows in micro-batches of 1; 2 ranks under a token
    budget (micro-batches formed by tokens, the same count on both ranks): one update, one loss."""
    common = ["actor.grad_clip=0"]
    one = _probe(tmp_path, "one", common + ["actor.micro_batch_size=8"])
    two = _probe(tmp_path, "two", common + ["actor.micro_batch_size=1"], nproc=2)
    _same_update(one, two)
    budget = _probe(tmp_path, "budget", common + ["actor.micro_batch_size=4", "actor.max_tokens_per_micro_batch=24"],
                    nproc=2)
    _same_update(one, budget)


@pytest.mark.slow
def test_launch_sft_under_torchrun(tmp_path):
    """``torchrun --nproc_per_node 2 launch/sft.py``: the launcher's ranks, one summary line, the metrics, the data
    report and an export that loads as the RL job's model.path."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           os.path.join(ROOT, "launch", "sft.py"), *merged([f"trainer.output_dir={out}", "trainer.total_steps=2"], SMALL)]
    proc = run_group(cmd, env=base_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "world_size=2" in proc.stdout and "sft: steps=2" in proc.stdout
    assert [r["step"] for r in rows(out)] == [0, 1, 2]
    report = json.loads((out / "data_report.json").read_text())
    assert report["train"]["kept"] == 64 and report["val"]["kept"] == 8
    from verl_ds.run.startup import check_startup

    # the RL job's start-up gate takes it as model.path (config.json and tokenizer files present)
    check_startup(load_config(None, [f"model.path={out / 'hf_actor'}", f"trainer.output_dir={tmp_path / 'ppo'}"]))
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(out / "hf_actor")


def test_another_jobs_checkpoint_is_refused_by_name(tmp_path):
    from verl_ds.checkpoint import CheckpointError

    class OtherJob(SFTJob):
        name = "other"

    fit(tmp_path / "run", "trainer.total_steps=1")
    cfg = load_config(None, merged([f"trainer.output_dir={tmp_path / 'run'}"], SMALL, ["trainer.total_steps=2"]))
    job = OtherJob(cfg, detect_launch({}))
    with pytest.raises(CheckpointError, match="written by the sft job, not by other"):
        job.fit()


def test_every_zero_stage_and_offload_train_the_same(tmp_path):
    """ZeRO-0, 1, 2 and 3 with the optimizer offloaded: the same initial weights, so the same first loss and
    nearly the same second (the optimizer's arithmetic is the same; only float summation orders differ)."""
    runs = {}
    for name, overrides in (("z3", []), ("z0", ["deepspeed.zero_stage=0"]), ("z1", ["deepspeed.zero_stage=1"]),
                            ("z2", ["deepspeed.zero_stage=2"]), ("z3off", ["deepspeed.offload=[optimizer]"])):
        fit(tmp_path / name, "trainer.total_steps=2", "trainer.export=none", *overrides)
        runs[name] = [r["sft/loss"] for r in rows(tmp_path / name) if "sft/loss" in r]
    for name, losses in runs.items():
        assert losses[0] == pytest.approx(runs["z3"][0], rel=1e-6), name
        assert losses[1] == pytest.approx(runs["z3"][1], rel=1e-4), name
        assert losses[1] < losses[0]


@pytest.mark.slow
def test_sft_under_the_deepspeed_launcher_and_the_slurm_task_script(tmp_path):
    """``deepspeed --num_gpus 2 launch/sft.py`` and two ``slurm/task.sh`` ranks (SLURM_* emulated, TRAIN_SCRIPT
    =launch/sft.py): both finish on 2 ranks with the same losses (the same seed, the same global batches)."""
    import subprocess

    args = ["trainer.total_steps=2", "trainer.export=none", *SMALL]
    ds_out, slurm_out = tmp_path / "deepspeed", tmp_path / "slurm"
    procs = [subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "deepspeed"), "--num_gpus", "2",
                               "--master_port", str(free_port()), os.path.join(ROOT, "launch", "sft.py"),
                               "--config", SFT_CONFIG, f"trainer.output_dir={ds_out}", *args],
                              cwd=ROOT, env=base_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)]
    port = free_port()
    for r in range(2):
        env = base_env(SLURM_PROCID=r, SLURM_LOCALID=r, SLURM_NTASKS=2, SLURM_NODELIST="localhost", MASTER_PORT=port,
                       REPO_DIR=ROOT, CONFIG="configs/sft.yaml", OUTPUT_DIR=slurm_out, PYTHON=sys.executable,
                       TRAIN_SCRIPT="launch/sft.py")
        procs.append(subprocess.Popen([os.path.join(ROOT, "slurm", "task.sh"), *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert "launcher=deepspeed world_size=2" in outputs[0] and "launcher=slurm world_size=2" in outputs[1]
    losses = [[r["sft/loss"] for r in rows(out) if "sft/loss" in r] for out in (ds_out, slurm_out)]
    assert len(losses[0]) == 2 and losses[0] == pytest.approx(losses[1], rel=1e-6)
