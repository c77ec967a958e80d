"""The CPU-only speed settings that stayed in verl_ds; each is off on CUDA, where DeepSpeed's defaults stand.

Issue 32 took out of the package the CPU-fitted code whose gain on the default job (``python launch/train.py``)
was under ~10% in an interleaved A/B, or that had no GPU counterpart. One setting is left:

``memory_efficient_linear: false`` in every ZeRO-3 DeepSpeed config of a CPU run. DeepSpeed's default (true)
replaces ``torch.nn.functional.linear`` for the whole process, for good, once any ZeRO-3 model is built
(``zero.Init``: "This will persist unless manually reset"), so every linear, the generation replica's included,
runs through its Python autograd Function. On a GPU that saves activation memory; on a CPU it only costs time.
The update is the same either way (ZeRO-3 re-gathers a weight before its backward). Default job, steps alternating
between the two linears in one process, 2 CPU cores under a load average of 7-12 from other jobs: torch's linear
7.3% faster per step at 1 thread (74 pairs; per-arm medians 684 vs 724 ms, CPU time alike); at the default 2
threads steps took ~20 s instead of ~0.2 s and the figure is noise-bound (16 pairs: median paired ratio 1.14,
per-arm medians 1.7% apart). Borderline against issue 32's 10% bar: kept because turning it on changes F.linear for
every CPU process that builds a ZeRO-3 model (the test suite's bitwise comparisons included); re-time it on an
idle machine before relying on either figure.
"""
from __future__ import annotations

__all__ = ["zero3_overrides"]


def zero3_overrides(gpu: bool) -> dict:
    """Entries for a ZeRO-3 ``zero_optimization`` section: the CPU settings above, none on a GPU."""
    return {} if gpu else {"memory_efficient_linear": False}
