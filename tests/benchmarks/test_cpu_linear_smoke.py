"""benchmarks/cpu_linear.py still runs at tiny shapes and prints its figures (no timing is asserted); its stack
runs every product of every layer, each with the shapes it says."""
import re

import pytest
import torch

from benchmark_scripts import load_benchmark
from verl_ds.engines import cpu_linear


def _load():
    return load_benchmark("cpu_linear")


@pytest.mark.skipif(not cpu_linear.onednn_available(), reason="torch without oneDNN")
def test_runs_and_prints_its_ratios(capsys):
    _load().main(["--hidden", "16", "--intermediate", "24", "--layers", "2", "--heads", "4", "--kv-heads", "2",
                  "--tokens", "3,5", "--repeats", "1"])
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    figures = dict(kv.split("=") for kv in last.split()[1:])
    assert last.startswith("cpu_linear ") and set(figures) == {
        "forward_ratio", "train_ratio", "verl_ds_forward_ratio", "verl_ds_train_ratio", "auto", "threads"}
    assert all(float(figures[k]) > 0 for k in figures if k.endswith("_ratio"))
    assert len(re.findall(r"^\s+[35] (forward|train) ", out, re.M)) == 4


def test_flop_count_and_the_stack_by_hand():
    bench = _load()
    weights = bench.layer_weights(hidden=4, intermediate=6, layers=2, kv_width=2)
    assert [tuple(w.shape) for w in weights[0]] == [(4, 4), (2, 4), (2, 4), (4, 4), (6, 4), (6, 4), (4, 6)]
    per_token = sum(w.numel() for layer in weights for w in layer)
    assert bench.flop(weights, 3, train=False) == 2 * 3 * per_token
    assert bench.flop(weights, 3, train=True) == 4 * 3 * per_token
    forwards, grads = [], []

    def forward(x, w):  # x (M, in) against W (out, in)
        forwards.append(x.shape[1] == w.shape[1])
        return x @ w.t()

    def input_grad(dy, w):  # dy (M, out) against W (out, in)
        grads.append(dy.shape[1] == w.shape[0])
        return dy @ w

    per_weight = [[forward] * 7, [forward] * 7], [[input_grad] * 7, [input_grad] * 7]  # one function per weight
    bench.run_stack(weights, torch.randn(3, 4), *per_weight, {w.shape[0]: torch.zeros(3, w.shape[0])
                                                              for w in weights[0]})
    assert forwards == [True] * 2 * 7 and grads == [True] * 2 * 7  # every product of both layers, each shape right
