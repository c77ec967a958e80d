"""The Models module: components with explicit role contracts (``verl_ds.models.base``) that the trainer schedules:
PolicyModel, ReferenceModel, ValueModel + CriticLM, RewardModel, and PPOModel, the algorithm over them.
"""
from verl_ds.models.base import (ActionRole, BaseModel, LogProbRole, MissingModuleError, RewardRole, TrainableRole,
                                 ValueRole)
from verl_ds.models.policy import PolicyModel, ReferenceModel
from verl_ds.models.ppo import PPOModel
from verl_ds.models.reward import RewardFunctionError, RewardModel
from verl_ds.models.value import CriticLM, ValueModel

__all__ = ["BaseModel", "MissingModuleError", "ActionRole", "LogProbRole", "ValueRole", "RewardRole", "TrainableRole",
           "PolicyModel", "ReferenceModel", "ValueModel", "CriticLM", "RewardModel", "RewardFunctionError", "PPOModel"]
