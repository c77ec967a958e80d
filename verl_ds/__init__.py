"""verl_ds: PPO for HuggingFace causal LMs on DeepSpeed ZeRO-3 engines."""

__version__ = "0.1.0"
