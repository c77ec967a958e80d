"""Supervised fine-tuning on the RL job's actor (``verl-ds sft``; docs/stages.md): the token-mean cross entropy of the
completion (assistant) tokens, exact however the rows are split into micro-batches and ranks."""
from __future__ import annotations

import torch

from verl_ds.config import Config, ConfigError
from verl_ds.sft_loss import response_nll
from verl_ds.stages.spine import StageData, StageJob


def load_sft_data(cfg: Config) -> StageData:
    """The tokenizer and the (train, val) SFT rows of ``cfg`` (files, or the built-in task's demonstrations)."""
    from verl_ds.engines.build import load_tokenizer
    from verl_ds.stages.sft_data import SFTDataset
    from verl_ds.tasks import parity

    tok = load_tokenizer(cfg)
    d = cfg.data
    options = dict(prompt_key=d.prompt_key, max_prompt_length=d.max_prompt_length,
                   max_completion_length=cfg.sft.max_completion_length, overlong=d.overlong,
                   apply_chat_template=d.apply_chat_template)
    if d.train_files is None:
        def rows(n, seed):
            return [{"prompt": p, "completion": " " + c} for p, c in parity.sft_examples(n, seed=seed)]

        train = SFTDataset.from_records(rows(d.num_train_prompts, cfg.trainer.seed), tok, source="parity demonstrations",
                                        **options)
        val = SFTDataset.from_records(rows(d.num_val_prompts, 10_000 + cfg.trainer.seed), tok,
                                      source="parity demonstrations (held out)", **options)
    else:
        train, val = _from_file("data.train_files", d.train_files, tok, options), None
        if d.val_files is not None:
            val = _from_file("data.val_files", d.val_files, tok, options)
    per_step = cfg.actor.mini_batch_size
    if len(train) < per_step:
        raise ConfigError(f"actor.mini_batch_size={per_step} is larger than the {len(train)} usable rows of "
                          f"{'data.train_files' if d.train_files else 'data.num_train_prompts'} ({train.summary()}); "
                          "a step takes actor.mini_batch_size distinct rows")
    return StageData(tok, train, val)


def _from_file(key: str, path: str, tok, options: dict):
    from verl_ds.stages.sft_data import SFTDataset

    try:
        return SFTDataset.from_file(path, tok, **options)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from None


class SFTJob(StageJob):
    """The SFT job."""

    name = section = "sft"

    @classmethod
    def load_data(cls, cfg: Config) -> StageData:
        return load_sft_data(cfg)

    def setup(self) -> None:
        from verl_ds.models.policy import ReferenceModel

        # the actor's scoring forward (log-probs of the response tokens), under grad here
        self.model = ReferenceModel(self.engine, remove_padding=self.packed, fused_lm_head=self.cfg.model.fused_lm_head)

    def units(self, items: list) -> int:
        return sum(sum(x["loss_mask"]) for x in items)

    def row_tokens(self, item) -> int:
        return len(item["prompt_ids"]) + len(item["response_ids"])

    def loss(self, items: list, normalizer: torch.Tensor) -> tuple:
        nll = response_nll(self.model, items, self.tokenizer.pad_token_id, self.engine.device)
        return nll / normalizer.to(nll.device, nll.dtype), {"loss": nll.detach()}


JOB = SFTJob
