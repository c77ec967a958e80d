"""Jobs besides the RL trainer: supervised fine-tuning, reward-model training and DPO."""
