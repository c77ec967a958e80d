"""Shipped tasks: `parity` (the default synthetic job) and `gsm8k` (a tiny GSM8K-style word-problem set)."""
from verl_ds.tasks import gsm8k, parity

__all__ = ["gsm8k", "parity"]
