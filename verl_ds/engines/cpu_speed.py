"""DeepSpeed settings for CPU runs only (on CUDA DeepSpeed's defaults stand): ``memory_efficient_linear: false``
under ZeRO-3, since DeepSpeed's process-wide swap of ``F.linear`` saves activation memory on a GPU but only costs
time on a CPU (the same update either way). Figures: benchmarks/README.md, "Measurements behind defaults"."""
from __future__ import annotations

__all__ = ["zero3_overrides"]


def zero3_overrides(gpu: bool) -> dict:
    """Entries for a ZeRO-3 ``zero_optimization`` section: the CPU settings above, none on a GPU."""
    return {} if gpu else {"memory_efficient_linear": False}
