"""Fused Triton kernels (installed as ``verl_ds.kernels``); ``dispatch`` picks Triton or torch."""
