"""The Linear layers of a float32 CPU model on oneDNN against torch's F.linear (``model.cpu_linear``), timed in the
same run.

A stack of decoder layers' products (q, k, v, o, gate, up, down of a Llama: hidden H, MLP I, KV width
H * kv_heads / heads), each layer's weights its own tensors (cold in the caches, as in a real forward), run on M
tokens: the forward (x W^T), and forward plus the input gradient (dy W) as a training micro-batch computes them
(the weight gradient stays a torch product on both backends, so it is left out). Three ways: torch's F.linear,
oneDNN for every product, and what ``model.cpu_linear=onednn`` does (layers that ``use_onednn_linears`` converts
take ``cpu_linear.linear``: oneDNN from ``MIN_MACS`` multiply-adds up, F.linear below; the others F.linear). They
alternate run by run, each going first in turn, so that a machine whose speed drifts weighs on each alike; each
figure is the median.

    python benchmarks/cpu_linear.py                      # the 30M shapes of e2e_vs_trl (H 512, I 2048, 8 layers)
    python benchmarks/cpu_linear.py --hidden 64 --intermediate 128 --layers 2 --tokens 16,64

Prints one row per token count (ms per pass, GFLOP/s, oneDNN / torch, verl_ds / torch) and the last line

    cpu_linear forward_ratio=<oneDNN / torch time, forward> train_ratio=<the same, forward + input gradient>
    verl_ds_forward_ratio=<verl_ds / torch> verl_ds_train_ratio=<...> auto=<what model.cpu_linear=auto picks here>
    threads=<N>

(ratios < 1: faster than torch; the geometric mean over the token counts).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # verl_ds from this checkout

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from verl_ds.engines import cpu_linear  # noqa: E402


def layer_weights(hidden: int, intermediate: int, layers: int, kv_width: int, seed: int = 0) -> list:
    """Per layer: (out, in) float32 weights of q, k, v, o, gate, up, down."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(hidden, hidden), (kv_width, hidden), (kv_width, hidden), (hidden, hidden), (intermediate, hidden),
              (intermediate, hidden), (hidden, intermediate)]
    return [[torch.randn(o, i, generator=g) * 0.02 for o, i in shapes] for _ in range(layers)]


def run_stack(weights: list, x: torch.Tensor, forwards: list, input_grads=None, grads: dict | None = None) -> None:
    """Every product of the stack on x (the attention and activations themselves are left out: the same on both
    backends), each weight's by its own function (``forwards``: per layer, one per weight); with ``input_grads``
    (the same layout), each product's dx too, from ``grads[out]``, a (tokens, out) output gradient."""
    for i, layer in enumerate(weights):
        (q, k, v, o, gate, up, down), (fq, fk, fv, fo, fg, fu, fd) = layer, forwards[i]
        h = fq(x, q)
        fk(x, k), fv(x, v)
        h = fo(h, o)
        out = fd(fg(h, gate) * fu(h, up), down)
        if input_grads is not None:
            for w, input_grad in zip(layer, input_grads[i]):
                input_grad(grads[w.shape[0]], w)
        x = out


def flop(weights: list, tokens: int, train: bool) -> float:
    n = sum(w.numel() for layer in weights for w in layer)
    return 2 * tokens * n * (2 if train else 1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=2048)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--tokens", default="128,140,563", help="comma-separated token counts (rows of each product)")
    p.add_argument("--repeats", type=int, default=9, help="runs of each backend per token count, alternating")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    if not cpu_linear.onednn_available():
        raise SystemExit("this torch build has no oneDNN inner product (torch.ops.mkldnn._linear_pointwise)")
    if a.repeats < 1 or a.hidden % a.heads or a.heads % a.kv_heads:
        raise SystemExit("--repeats must be >= 1, --hidden a multiple of --heads, --heads of --kv-heads")
    torch.set_num_threads(a.threads)
    weights = layer_weights(a.hidden, a.intermediate, a.layers, a.hidden // a.heads * a.kv_heads)
    def raw(x, w):  # oneDNN whatever the product's size
        return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    def converted(w) -> bool:  # whether use_onednn_linears puts a Linear of this weight on oneDNN
        return w.numel() * cpu_linear.CONVERT_MIN_TOKENS >= cpu_linear.MIN_MACS

    def per_weight(fwd, bwd) -> tuple:  # one function per weight, chosen once, outside the timed runs
        return ([[fwd(w) for w in layer] for layer in weights], [[bwd(w) for w in layer] for layer in weights])

    def torch_input_grad(dy, w):
        return dy @ w

    backends = {
        "torch": per_weight(lambda w: F.linear, lambda w: torch_input_grad),
        "onednn": per_weight(lambda w: raw, lambda w: lambda dy, w: raw(dy, w.t())),
        # model.cpu_linear=onednn: a converted layer's products on oneDNN from MIN_MACS up, the others F.linear
        "verl_ds": per_weight(lambda w: cpu_linear.linear if converted(w) else F.linear,
                              lambda w: cpu_linear.linear_input_grad if converted(w) else torch_input_grad)}
    auto = cpu_linear.resolve_cpu_linear("auto")
    print(f"cpu_linear: hidden {a.hidden}, MLP {a.intermediate}, {a.layers} layers, {a.threads} thread(s), "
          f"{torch.backends.cpu.get_cpu_capability()}, vendor {cpu_linear._cpu_vendor() or 'unknown'}, "
          f"model.cpu_linear=auto picks {auto}, torch {torch.__version__}")
    header = (f"{'tokens':>6s} {'pass':8s} {'torch ms':>9s} {'GFLOP/s':>8s} {'oneDNN ms':>10s} {'GFLOP/s':>8s} "
              f"{'ratio':>6s} {'verl_ds ratio':>13s}")
    print(header + "\n" + "-" * len(header))
    ratios = {"forward": [], "train": [], "verl_ds_forward": [], "verl_ds_train": []}
    with torch.no_grad():
        for tokens in (int(t) for t in a.tokens.split(",") if t.strip()):
            g = torch.Generator().manual_seed(tokens)
            x = torch.randn(tokens, a.hidden, generator=g)
            grads = {w.shape[0]: torch.randn(tokens, w.shape[0], generator=g) for w in weights[0]}
            for kind in ("forward", "train"):
                times = {name: [] for name in backends}
                names = list(backends)
                for r in range(a.repeats + 1):  # the first round warms up (oneDNN builds its kernels per shape)
                    for name in names[r % 3:] + names[:r % 3]:  # each way goes first, second and third in turn
                        fwd, bwd = backends[name]
                        t0 = time.perf_counter()
                        run_stack(weights, x, fwd, bwd if kind == "train" else None, grads)
                        times[name].append(time.perf_counter() - t0)
                t_torch, t_dnn, t_ours = (statistics.median(times[n][1:]) for n in ("torch", "onednn", "verl_ds"))
                f = flop(weights, tokens, kind == "train")
                ratios[kind].append(t_dnn / t_torch)
                ratios[f"verl_ds_{kind}"].append(t_ours / t_torch)
                print(f"{tokens:6d} {kind:8s} {t_torch * 1e3:9.2f} {f / t_torch / 1e9:8.1f} {t_dnn * 1e3:10.2f} "
                      f"{f / t_dnn / 1e9:8.1f} {t_dnn / t_torch:6.3f} {t_ours / t_torch:13.3f}", flush=True)
    geo = {k: math.exp(statistics.fmean(math.log(r) for r in v)) for k, v in ratios.items()}
    print("cpu_linear " + " ".join(f"{k}_ratio={v:.3f}" for k, v in geo.items()) + f" auto={auto} threads={a.threads}")


if __name__ == "__main__":
    main()
