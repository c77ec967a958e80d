"""Direct preference optimisation (Rafailov et al. 2023) of the RL job's actor on preference pairs (``verl-ds dpo``;
docs/stages.md). The reference is the initial actor: a frozen engine, the actor with its LoRA adapters off, or none
(``dpo.reference_free``); log-probs come from the actor's scoring forward, packed where the model supports it."""
from __future__ import annotations

import torch

from verl_ds.config import Config
from verl_ds.stages.spine import StageData, StageJob


class DPOJob(StageJob):
    """The DPO job."""

    name = section = "dpo"

    @classmethod
    def load_data(cls, cfg: Config) -> StageData:
        from verl_ds.stages.pairs import load_pair_data

        return load_pair_data(cfg, cls.name)

    def engine_roles(self) -> tuple:
        # a LoRA actor is its own reference (adapters off); reference-free DPO has none
        if self.cfg.dpo.reference_free or self.cfg.actor.lora_rank > 0:
            return ("actor",)
        return ("actor", "ref")

    def setup(self) -> None:
        from verl_ds.models.policy import AdaptersOffReferenceModel, ReferenceModel

        opts = dict(remove_padding=self.packed, fused_lm_head=self.cfg.model.fused_lm_head)
        self.policy = ReferenceModel(self.engine, **opts)  # the scoring forward, under grad here
        if self.cfg.dpo.reference_free:
            self.reference = None
        elif self.cfg.actor.lora_rank > 0:
            self.reference = AdaptersOffReferenceModel(self.engine, **opts)
        else:
            self.reference = ReferenceModel(self.engines["ref"], **opts)

    def units(self, items: list) -> int:
        return len(items)

    def row_tokens(self, item) -> int:
        from verl_ds.stages.pairs import pair_tokens

        return pair_tokens(item)

    def sequence_logps(self, model, batch: dict) -> torch.Tensor:
        """(2B,) each row's completion log-prob under ``model`` (summed; averaged for IPO)."""
        from verl_ds.stages.losses import sequence_logps

        device = self.engine.device
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        R = batch["response_mask"].shape[1]
        token_logps = model.get_logprob(ids, ids[:, -R:], mask)
        return sequence_logps(token_logps, batch["response_mask"].to(device), average=self.cfg.dpo.loss == "ipo")

    def loss(self, items: list, normalizer: torch.Tensor) -> tuple:
        from verl_ds.stages.losses import dpo_loss
        from verl_ds.stages.pairs import collate_pairs

        batch = collate_pairs(items, self.tokenizer.pad_token_id)
        n, d = len(items), self.cfg.dpo
        logps = self.sequence_logps(self.policy, batch)
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = self.sequence_logps(self.reference, batch)
        losses, m = dpo_loss(logps[:n], logps[n:], None if ref is None else ref[:n], None if ref is None else ref[n:],
                             beta=d.beta, loss_type=d.loss, label_smoothing=d.label_smoothing,
                             reference_free=d.reference_free)
        total = losses.sum()
        return total / normalizer.to(total.device, total.dtype), {"loss": total, **{k: v * n for k, v in m.items()}}


JOB = DPOJob
