"""Reward-model training: a sequence classifier (one label) with the Bradley-Terry loss on preference pairs
(``verl-ds rm``; docs/stages.md). A sequence's reward is the RL job's ``LastTokenScorer`` score, so the export loads as
the RL job's ``reward.model_path`` and scores a rollout as it was trained."""
from __future__ import annotations

import torch

from verl_ds.config import Config
from verl_ds.hf_module import unwrap_module
from verl_ds.models.reward import LastTokenScorer
from verl_ds.stages.spine import StageData, StageJob


def build_reward_classifier(cfg: Config, tok, ds_config: dict | None = None):
    """The classifier the job trains: ``model.path``'s backbone with a fresh score head, or the tiny config's model;
    created already partitioned under ZeRO-3."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from verl_ds.config import ConfigError
    from verl_ds.engines.build import _dtype, _tiny_lm_config, check_vocab, disable_dropout, init_tiny_weights
    from verl_ds.weights.zero3 import has_partitioned_params, partitioned_construction

    with torch.random.fork_rng(devices=[]), partitioned_construction(ds_config):
        torch.manual_seed(cfg.model.init_seed)
        if cfg.model.path is None:
            config = _tiny_lm_config(cfg, tok)
            config.num_labels = 1
            model = AutoModelForSequenceClassification.from_config(config)
            init_tiny_weights(model, cfg.model.init_seed, config.initializer_range)
        else:
            try:
                config = AutoConfig.from_pretrained(cfg.model.path, num_labels=1)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"model.path: {cfg.model.path!r} is not a HF model directory ({exc})") from None
            # the classifier pools at the last non-pad token: it must know the pad id (ours reads the last real token)
            if config.pad_token_id is None:
                config.pad_token_id = tok.pad_token_id
            model = AutoModelForSequenceClassification.from_pretrained(cfg.model.path, config=config,
                                                                       dtype=_dtype(cfg))
    check_vocab(model, tok, "reward model")
    disable_dropout(model)
    return model if has_partitioned_params(model) else model.to(_dtype(cfg))


class RewardModelJob(StageJob):
    """The reward-model job."""

    name = section = "rm"
    export_name = "hf_reward_model"
    lora_task_type = "SEQ_CLS"  # peft trains the score head whole (modules_to_save); output-head adapts nothing
    packs_rows = False  # scored on padded rows, as the RL job's RewardModel scores

    @classmethod
    def load_data(cls, cfg: Config) -> StageData:
        from verl_ds.stages.pairs import load_pair_data

        return load_pair_data(cfg, cls.name)

    def build_model(self, ds_config: dict):
        return build_reward_classifier(self.cfg, self.tokenizer, ds_config)

    def setup(self) -> None:
        self.scorer = LastTokenScorer(self.engine)
        if self.scorer.hook is None:  # HF's own pooling would score a different token than the RL job reads
            raise TypeError(f"the reward model must be a HF sequence classifier with a `score` head, got "
                            f"{type(unwrap_module(self.engine)).__name__}")

    def units(self, items: list) -> int:
        return len(items)

    def row_tokens(self, item) -> int:
        from verl_ds.stages.pairs import pair_tokens

        return pair_tokens(item)

    def rewards(self, items: list) -> tuple:
        """(chosen (B,), rejected (B,)) rewards of the pairs ``items``."""
        from verl_ds.stages.pairs import collate_pairs

        batch = collate_pairs(items, self.tokenizer.pad_token_id)
        ids, mask = batch["input_ids"].to(self.engine.device), batch["attention_mask"].to(self.engine.device)
        r = self.scorer(ids, mask, "RewardModelJob.rewards")
        return r[:len(items)], r[len(items):]

    def loss(self, items: list, normalizer: torch.Tensor) -> tuple:
        from verl_ds.stages.losses import reward_model_loss

        chosen, rejected = self.rewards(items)
        losses, m = reward_model_loss(chosen, rejected)
        total, n = losses.sum(), len(items)
        return total / normalizer.to(total.device, total.dtype), {"loss": total, "accuracy": m["accuracy"] * n,
                                                                  "margin": m["margin"] * n}

    def close(self, code: int = 0) -> None:
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        super().close(code)


JOB = RewardModelJob
