"""benchmarks/gpu_check.sh and its Python parts on a CPU: the script parses and refuses a machine without CUDA; the
attention check's own machinery (its batches, its per-sequence reference, its leak control) against today's
per-sequence loop; both Python parts at their tiny sizes through their command lines (the full run where this tree
has ``model.attn_implementation``, else the exit-2 message saying it has not); and no script in benchmarks/ shadows
an installed module."""
import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from benchmark_scripts import BENCHMARKS, load_benchmark

ROOT = str(BENCHMARKS.parent)
NO_KEY = "model.attn_implementation is not a config key of this verl_ds tree"


def _has_attn_key() -> bool:
    return load_benchmark("gpu_attention_check").config_error("auto") is None


def _run(args, timeout):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore::FutureWarning")
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_no_script_in_benchmarks_shadows_an_installed_module(tmp_path):
    # `python benchmarks/x.py` puts benchmarks/ first on sys.path: a script named like an installed top-level module
    # (benchmarks/kernels.py and Hugging Face's `kernels`, which transformers 5.25 imports) breaks every script there
    names = sorted(p.stem for p in BENCHMARKS.glob("*.py"))
    code = "import importlib.util, sys; print([n for n in sys.argv[1:] if importlib.util.find_spec(n) is not None])"
    proc = subprocess.run([sys.executable, "-c", code, *names], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"benchmarks/ scripts named like installed modules: {proc.stdout}"


def test_gpu_check_sh_parses_and_refuses_a_machine_without_cuda(tmp_path):
    assert subprocess.run(["bash", "-n", str(BENCHMARKS / "gpu_check.sh")], timeout=60).returncode == 0
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible: the script would run the whole check")
    proc = subprocess.run(["bash", str(BENCHMARKS / "gpu_check.sh")], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path / "out")))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "sees no CUDA device" in proc.stderr


def test_attention_check_machinery_against_the_per_sequence_loop():
    """The check's batch, reference and comparison on today's loop (the model the trainer builds without the new key):
    every layout equals each sequence run alone (fp32), the shared-prefix batch really shares response prefixes, and
    the leak control lands far from the reference, so a lost layout would fail the check."""
    from transformers import AutoModelForCausalLM

    from verl_ds.prompt_sharing import pack_shared_prompts

    mod = load_benchmark("gpu_attention_check")
    size = mod.SIZES["tiny"]
    model, support = mod.build(None, size, "fp32", "cpu", 512, 32, 0.2)
    assert support.packing is None and support.sharing is None
    from verl_ds.attention_layout import packed_attention

    assert model.config._attn_implementation == packed_attention(mod.LOOP, True, "cpu")[0]
    ref = AutoModelForCausalLM.from_config(copy.deepcopy(model.config), attn_implementation="sdpa")
    ref.load_state_dict(model.state_dict())
    for layout in mod.LAYOUTS:
        obs, mask, R = mod.make_batch(size, 512, "cpu", layout == "shared_prefixes")
        diff = mod.compare(model, ref, obs, mask, R, layout)
        assert diff["logprob"] < 1e-4 and diff["entropy"] < 1e-4 and diff["grad_rel"] < 1e-3, (layout, diff)
        if layout == "shared_prefixes":
            assert pack_shared_prompts(obs, mask, R, share_prefixes=True).targets.take is not None
        assert mod.time_step(model, obs, mask, R, layout, reps=1) > 0
    from verl_ds.attention_layout import packed_attention

    assert model.config._attn_implementation == packed_attention(mod.LOOP, True, "cpu")[0]  # the reference's build left the checked model alone
    obs, mask, R = mod.make_batch(size, 512, "cpu", False)
    real = mask[:, -R:]
    with torch.no_grad():
        want = mod.per_sequence(ref, obs, mask, R)[0]
        leaked = ((mod.leak(ref, obs, mask, R) - want).abs() * real).sum() / real.sum()
    assert leaked > 10 * mod.TOL["bf16"]["logprob_mean"]


@pytest.mark.timeout(900)
def test_attention_check_command_line_on_cpu(tmp_path):
    out = tmp_path / "attention.json"
    proc = _run([sys.executable, str(BENCHMARKS / "gpu_attention_check.py"), "--device", "cpu", "--tiny",
                 "--layouts", "plain,shared_prompts", "--reps", "1", "--json", str(out)], timeout=800)
    text = proc.stdout + proc.stderr
    assert "attention flash_attention_2: skipped (flash_attention_2 needs CUDA)" in proc.stdout, text
    assert "attention flex_attention: skipped (flex_attention on a CPU" in proc.stdout, text
    if not _has_attn_key():
        assert proc.returncode == 2 and NO_KEY in proc.stderr, text
        return
    assert proc.returncode == 0, text
    assert re.search(r"^gpu_attention_check ok=1 ", proc.stdout.splitlines()[-1]), text
    rows = json.loads(out.read_text())["rows"]
    assert {(r["impl"], r["layout"]) for r in rows} == {(i, lay) for i in ("sdpa", "auto")
                                                      for lay in ("plain", "shared_prompts")}


@pytest.mark.slow  # with the key: two launch/train.py runs
@pytest.mark.timeout(1500)
def test_grpo_check_command_line_on_cpu(tmp_path):
    proc = _run([sys.executable, str(BENCHMARKS / "gpu_grpo_check.py"), "--device", "cpu", "--tiny", "--timeout",
                 "600", "--out", str(tmp_path)], timeout=1400)
    text = proc.stdout + proc.stderr
    if not _has_attn_key():
        assert proc.returncode == 2 and NO_KEY in proc.stderr and "nothing was run" in proc.stderr, text
        return
    assert proc.returncode == 0, text
    last = re.fullmatch(r"gpu_check attention_step_ratio=(\S+) tokens_per_s=(\S+) peak_mem_gib=(\S+)",
                        proc.stdout.splitlines()[-1])
    assert last and all(float(x) > 0 for x in last.groups()), text
    runs = json.loads((tmp_path / "grpo_check.json").read_text())["runs"]
    assert set(runs) == {"sdpa", "auto"} and all(len(r["steps"]) == 3 for r in runs.values())


def test_grpo_check_refuses_a_name_or_a_missing_key_before_running(tmp_path):
    mod = load_benchmark("gpu_grpo_check")
    problem = mod.config_problem(["surely_not_an_attention"])
    if _has_attn_key():
        assert problem.startswith("model.attn_implementation=surely_not_an_attention is refused")
    else:
        assert problem.startswith(NO_KEY)
    assert mod.main(["--device", "cpu", "--tiny", "--impl", "surely_not_an_attention"]) == 2
    assert mod.main(["--device", "cpu", "--tiny", "--steps", "1"]) == 2
