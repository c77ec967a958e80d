"""The Models module: components with explicit contracts that the trainer schedules.

BaseModel (the contract), PolicyModel (actor / reference), ValueModel + CriticLM (critic),
RewardModel (neural scorer and reward functions), PPOModel + PPOConfig (the PPO calls).
"""
from verl_ds.models.base import BaseModel, MissingModuleError
from verl_ds.models.policy import PolicyModel
from verl_ds.models.ppo import PPOConfig, PPOModel
from verl_ds.models.reward import RewardFunctionError, RewardModel
from verl_ds.models.value import CriticLM, ValueModel

__all__ = ["BaseModel", "MissingModuleError", "PolicyModel", "ValueModel", "CriticLM", "RewardModel",
           "RewardFunctionError", "PPOModel", "PPOConfig"]
