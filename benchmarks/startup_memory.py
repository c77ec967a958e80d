"""Start-up memory of the PPO components at world size 1 and 2: does ZeRO-3 partitioning reach construction?

Writes a Llama-style checkpoint of ``--params`` parameters (random weights, safetensors shards, the
built-in tokenizer) to a temp directory, then, on 1 rank and on 2 ranks (gloo, subprocesses), builds
what the trainer builds from it: actor and critic (ZeRO-3, AdamW) and the frozen reference, fp32 on CPU,
through ``verl_ds.engines.build`` (``build_engines`` where it exists; on older code the trainer's own
sequence: build_actor_model, a reference loaded from the actor's state dict, build_critic_model,
make_engine). Each rank reports its RSS before model construction and its peak RSS during it (the
kernel's VmHWM, reset just before). At world size 2 it then exports the actor in HF format
(``verl_ds.export.export_hf``; on older code the trainer's gather-everything export) and reports each
rank's peak during the export.

    model_states_ratio = (world-2 peak - world-2 baseline) / (world-1 peak - world-1 baseline), larger rank

0.5 is perfect partitioning (each of 2 ranks holds half of everything); 1.0 means every rank holds what a
single rank holds. The last line is machine-readable:

    startup_memory params=<n> world1_peak_gib=<x> world2_peak_gib=<y> model_states_ratio=<r>

    python benchmarks/startup_memory.py --params 300M      # ~13 GiB at world size 1; minutes on 2 cores
    PYTHONPATH=/path/to/older/checkout python benchmarks/startup_memory.py --params 300M   # the baseline
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile

GiB = 2**30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = r'''
import json, os, resource, sys, time
import torch

def rss():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def rss_parts():
    """Anonymous (heap, tensors) and file-backed (mapped checkpoint files) resident bytes."""
    with open("/proc/self/status") as fh:
        text = fh.read()
    return {k: int(re.search(rf"{k}:\s+(\d+) kB", text).group(1)) * 1024 for k in ("RssAnon", "RssFile")}

def trim():
    """Give the heap's free pages back to the OS (glibc): what is left is really held."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    return rss()

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False

def peak(reset_ok):
    if reset_ok:
        with open("/proc/self/status") as fh:
            return int(re.search(r"VmHWM:\s+(\d+) kB", fh.read()).group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

import re
from verl_ds import dist as vdist
from verl_ds.config import load_config, validate
from verl_ds.engines import build

model_dir, out = sys.argv[1], sys.argv[2]
launch = vdist.detect_launch()
vdist.init_distributed(launch, 3600, "cpu")
cfg = load_config(None, [f"model.path={model_dir}", "trainer.device=cpu", "model.dtype=fp32"])
derived = validate(cfg, vdist.world_size())
tok = build.load_tokenizer(cfg)
import deepspeed, transformers  # noqa: F401  (imported before the baseline)
vdist.barrier()
res = {"baseline": rss()}
ok = reset_peak()
t0 = time.perf_counter()
if hasattr(build, "build_engines"):
    engines = build.build_engines(cfg, derived, tok, roles=("actor", "ref", "critic"))
    res["path"] = "build_engines"
else:  # the trainer's sequence before partitioned construction
    actor_model = build.build_actor_model(cfg, tok)
    ref_model = build.build_actor_model(cfg, tok)
    ref_model.load_state_dict(actor_model.state_dict())
    critic_model = build.build_critic_model(cfg, tok, actor_model=actor_model)
    a, c = cfg.actor, cfg.critic
    engines = {"actor": build.make_engine(actor_model, cfg, derived, "actor", lr=a.lr, weight_decay=a.weight_decay,
                                          grad_clip=a.grad_clip),
               "critic": build.make_engine(critic_model, cfg, derived, "critic", lr=c.lr,
                                           weight_decay=c.weight_decay, grad_clip=c.grad_clip),
               "ref": build.make_engine(ref_model, cfg, derived, "ref")}
    del actor_model, ref_model, critic_model
    res["path"] = "build_actor_model + make_engine"
vdist.barrier()
res["build_s"] = time.perf_counter() - t0
res["peak"] = peak(ok)
res["after_build"] = rss()
res["parts"] = rss_parts()
res["after_trim"] = trim()
if vdist.world_size() > 1:
    export_dir = os.path.join(os.path.dirname(out), "export")
    res["before_export"] = rss()
    ok = reset_peak()
    try:
        from verl_ds.export import export_hf
        export_hf(engines["actor"], tok, export_dir)
    except ImportError:  # the trainer's export before the streaming one
        from verl_ds.rollout import empty_like, gathered_state_dict
        state = gathered_state_dict(engines["actor"].module)
        if vdist.rank() == 0:
            model = empty_like(engines["actor"].module)
            model.load_state_dict(state)
            model.save_pretrained(export_dir, safe_serialization=True)
        del state
        vdist.barrier()
    res["export_peak"] = peak(ok)
with open(out % vdist.rank(), "w") as fh:
    json.dump(res, fh)
'''


def parse_count(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMB]?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"--params: expected a count such as 300M or 1.5B, got {text!r}")
    return int(float(m.group(1)) * {"": 1, "K": 10**3, "M": 10**6, "B": 10**9}[m.group(2)])


def llama_shape(params: int, vocab: int = 32000) -> dict:
    """A Llama config of about ``params`` parameters: the widest hidden size whose two embedding matrices stay
    under a quarter of the total, MLP 8/3 wide (rounded to 256), as many layers as fit."""
    hidden = 256
    for h in (256, 512, 768, 1024, 1536, 2048, 3072, 4096):
        if 2 * vocab * h <= params / 4:
            hidden = h
    inter = max(256, int(round(hidden * 8 / 3 / 256)) * 256)
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    layers = max(1, round((params - 2 * vocab * hidden - hidden) / per_layer))
    return dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                max_position_embeddings=512, tie_word_embeddings=False)


def write_checkpoint(directory: str, params: int) -> int:
    """Random N(0, 0.02) weights written tensor by tensor into 1 GB safetensors shards; returns the count."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ds.tasks import parity
    from verl_ds.tokenizer import build_tokenizer

    tok = build_tokenizer(parity.VOCAB)
    config = LlamaConfig(**llama_shape(params), pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in LlamaForCausalLM(config).named_parameters()}
    gen = torch.Generator().manual_seed(0)
    shard, size, files, index = {}, 0, [], {}

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        files.append(name)
        index.update({k: name for k in shard})
        shard, size = {}, 0

    for name, shape in shapes.items():
        value = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.02
        if shard and size + 4 * value.numel() > 10**9:
            flush()
        shard[name] = value
        size += 4 * value.numel()
    flush()
    total = sum(int(torch.Size(s).numel()) for s in shapes.values())
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": 4 * total}, "weight_map": index}, fh)
    config.dtype = torch.float32
    config.save_pretrained(directory)
    tok.save_pretrained(directory)
    return total


def run_world(world: int, model_dir: str, work: str) -> list:
    script = os.path.join(work, "worker.py")
    with open(script, "w") as fh:
        fh.write(WORKER)
    out = os.path.join(work, f"w{world}", "rank%d.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore",
                   TRANSFORMERS_VERBOSITY="error", PYTHONPATH=os.pathsep.join(
                       p for p in (os.environ.get("PYTHONPATH"), ROOT) if p))
        procs.append(subprocess.Popen([sys.executable, script, model_dir, out], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"world size {world} failed:\n" + "\n".join(log[-4000:] for log in logs))
    results = []
    for rank in range(world):
        with open(out % rank) as fh:
            results.append(json.load(fh))
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=parse_count, default=parse_count("300M"))
    p.add_argument("--worlds", default="1,2", help="world sizes to run (the ratio needs 1 and 2)")
    args = p.parse_args()
    sizes = [int(w) for w in args.worlds.split(",")]
    with tempfile.TemporaryDirectory(prefix="verl_ds_startup_") as work:
        model_dir = os.path.join(work, "model")
        os.makedirs(model_dir)
        n = write_checkpoint(model_dir, args.params)
        print(f"checkpoint: {n:,} parameters ({4 * n / GiB:.2f} GiB fp32), {llama_shape(args.params)}", flush=True)
        worlds = {}
        for world in sizes:
            worlds[world] = run_world(world, model_dir, work)
            for rank, r in enumerate(worlds[world]):
                print(f"world {world} rank {rank}: RSS before construction {r['baseline'] / GiB:.2f} GiB, peak "
                      f"{r['peak'] / GiB:.2f} GiB (+{(r['peak'] - r['baseline']) / GiB:.2f}), after "
                      f"{r['after_build'] / GiB:.2f} GiB (anon {r['parts']['RssAnon'] / GiB:.2f}, file "
                      f"{r['parts']['RssFile'] / GiB:.2f}; {r['after_trim'] / GiB:.2f} after malloc_trim), build "
                      f"{r['build_s']:.0f} s via {r['path']}", flush=True)
        for rank, r in enumerate(worlds.get(2, [])):
            print(f"export at world 2, rank {rank}: peak {r['export_peak'] / GiB:.2f} GiB "
                  f"(+{(r['export_peak'] - r['before_export']) / GiB:.2f} over {r['before_export'] / GiB:.2f})")
        if sorted(worlds) != [1, 2]:
            return
        delta = {w: max(r["peak"] - r["baseline"] for r in rs) for w, rs in worlds.items()}
        peaks = {w: max(r["peak"] for r in rs) for w, rs in worlds.items()}
        print(f"startup_memory params={n} world1_peak_gib={peaks[1] / GiB:.2f} world2_peak_gib={peaks[2] / GiB:.2f} "
              f"model_states_ratio={delta[2] / delta[1]:.3f}")


if __name__ == "__main__":
    main()
