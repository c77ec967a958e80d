"""DeepSpeed-Ulysses sequence parallelism on CPU: activation memory per rank and step time of one packed row's
forward + backward (``PolicyModel.get_logprob`` on packed rows, the trainer's update path), degree 2 (2 gloo ranks,
each a slice of the row) against degree 1 (the whole row on one rank), the same model and row.

    python benchmarks/sequence_parallel.py              # an 8192-token packed row (4 sequences of 2048)
    python benchmarks/sequence_parallel.py --quick      # a 512-token row, a smoke run

Activation memory: the bytes autograd saves for the backward during the forward (``saved_tensors_hooks``), each
storage counted once and the parameters left out: what a rank holds between forward and backward, the memory that
grows with the row's length. Step time: the median of ``--repeats`` forward + backward calls after one warm-up (wall
and the process's CPU time, which other jobs on the machine do not inflate); each rank runs one thread (degree 1 on
one rank, degree 2 on two: the speed-up is the second rank's work, given a free core). Ends with
``sequence_parallel activation_peak_ratio=<degree 2 / degree 1> step_time_ratio=<degree 2 / degree 1>``.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time

import torch


def _saved_bytes(params: set):
    """(hooks context, counter): bytes of the distinct non-parameter storages autograd saves."""
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in seen and key not in params and storage.nbytes():
            seen.add(key)
            total[0] += storage.nbytes()
        return t

    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), total


def _row(args):
    """One (1, T) batch: ``args.sequences`` sequences of prompt + response packed into ``args.tokens`` tokens."""
    from verl_ds.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    per = args.tokens // args.sequences
    prompt, response = 16, per - 16
    ids = torch.randint(3, args.vocab, (args.sequences, per), generator=g)
    return RolloutBatch.from_generation(ids[:, :prompt], torch.ones(args.sequences, prompt, dtype=torch.bool),
                                        ids[:, prompt:], pad_token_id=0, eos_token_id=2)


def _measure(args, sp) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ds.models import PolicyModel
    from verl_ds.models.sequence_parallel import register_ulysses
    from verl_ds.models.varlen_attention import VARLEN_ATTENTION, use_attention

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads // 2,
                      max_position_embeddings=args.tokens + 16, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    lm = LlamaForCausalLM(cfg)
    use_attention(lm, register_ulysses(VARLEN_ATTENTION) if sp else VARLEN_ATTENTION)
    policy = PolicyModel(lm, remove_padding=True, sequence_parallel=sp)
    b = _row(args)
    params = {p.untyped_storage().data_ptr() for p in lm.parameters()}
    times, cpu, saved = [], [], 0
    for i in range(args.repeats + 1):
        lm.zero_grad(set_to_none=True)
        hooks, total = _saved_bytes(params)
        start, start_cpu = time.perf_counter(), time.process_time()
        with hooks:
            lp, ent = policy.get_logprob(b.observation, b.action, b.mask, return_entropy=True)
        (lp * b.response_mask).sum().add((ent * b.response_mask).sum()).backward()
        if i:  # the first call warms up
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        saved = total[0]
    return {"saved_bytes": saved, "step_s": statistics.median(times), "cpu_s": statistics.median(cpu)}


def _rank(rank: int, port: int, out: str, args) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    from verl_ds.models.sequence_parallel import init_sequence_parallel

    deepspeed.init_distributed("gloo", auto_mpi_discovery=False)
    sp = init_sequence_parallel(2)
    result = {}
    if rank == 0:  # degree 1 first, alone (rank 1 waits at the barrier)
        result["degree1"] = _measure(args, None)
    dist.barrier()
    result["degree2"] = _measure(args, sp)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--sequences", type=int, default=4)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.tokens, args.sequences, args.repeats = 512, 2, 1
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(port, out, args), nprocs=2, start_method="spawn")
        r = [json.load(open(os.path.join(out, f"rank{i}.json"))) for i in range(2)]
    one, two = r[0]["degree1"], [x["degree2"] for x in r]
    peak2 = max(x["saved_bytes"] for x in two)
    step2 = max(x["step_s"] for x in two)
    mib = 2 ** 20
    print(f"packed row: {args.tokens} tokens ({args.sequences} sequences), Llama {args.layers} layers x hidden "
          f"{args.hidden}, {args.heads} heads ({args.heads // 2} key/value), vocab {args.vocab}, fp32, "
          f"1 thread per rank")
    print(f"degree 1: activations saved for backward {one['saved_bytes'] / mib:.1f} MiB, forward+backward "
          f"{one['step_s']:.3f} s wall, {one['cpu_s']:.3f} s CPU")
    for i, x in enumerate(two):
        print(f"degree 2 rank {i}: activations saved for backward {x['saved_bytes'] / mib:.1f} MiB, forward+backward "
              f"{x['step_s']:.3f} s wall, {x['cpu_s']:.3f} s CPU")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU time per rank, degree 2 / degree 1: {max(x['cpu_s'] for x in two) / one['cpu_s']:.3f} (the wall-time "
          f"ratio needs a free core per rank: load average {load:.1f} on {os.cpu_count()} cores)")
    print(f"sequence_parallel activation_peak_ratio={peak2 / one['saved_bytes']:.3f} "
          f"step_time_ratio={step2 / one['step_s']:.3f}")


if __name__ == "__main__":
    sys.exit(main())
