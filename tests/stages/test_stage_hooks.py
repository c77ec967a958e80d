"""The spine's hook for a model other than the configured causal LM (what a reward model uses): a sequence
classifier built under ZeRO-3 partitioned construction, trained whole or with LoRA adapters (its score head
trained whole), checkpointed and resumed like any stage."""
import pytest
import torch

from verl_ds.config import load_config
from verl_ds.dist import detect_launch
from verl_ds.weights.zero3 import partitioned_construction
from verl_ds.sft_loss import collate
from verl_ds.stages.sft import SFTJob


class ScoreJob(SFTJob):
    """Pulls a classifier's score of every row towards 1 (a squared error per row): a stage with its own model."""

    name = "score"
    lora_task_type = "SEQ_CLS"
    packs_rows = False

    def build_model(self, ds_config):
        from transformers import AutoModelForSequenceClassification, LlamaConfig

        tok = self.tokenizer
        with partitioned_construction(ds_config):
            return AutoModelForSequenceClassification.from_config(LlamaConfig(
                vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, num_labels=1, pad_token_id=tok.pad_token_id))

    def setup(self):
        pass

    def units(self, items):
        return len(items)

    def loss(self, items, normalizer):
        obs, mask, _ = collate(items, self.tokenizer.pad_token_id, self.engine.device)
        score = self.engine(input_ids=obs, attention_mask=mask.long()).logits.squeeze(-1)
        err = ((score - 1.0) ** 2).sum()
        return err / normalizer.to(err.dtype), {"loss": err.detach()}

    def export(self, directory):
        return directory


@pytest.mark.parametrize("lora", [0, 4])
def test_a_stage_trains_the_model_its_hook_builds(tmp_path, lora):
    cfg = load_config(None, [f"trainer.output_dir={tmp_path}", "model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64",
                             "data.num_train_prompts=64", "data.num_val_prompts=8", "actor.mini_batch_size=8",
                             "actor.micro_batch_size=4", "trainer.total_steps=6", "trainer.loggers=[plot]",
                             "actor.lr=1e-2", f"actor.lora_rank={lora}", "trainer.save_every=3"])
    job = ScoreJob(cfg, detect_launch({}))
    module = job.engine.module
    assert any(type(m).__name__ == "LlamaForSequenceClassification" for m in module.modules())
    assert not job.packed
    trained = {n for n, p in module.named_parameters() if p.requires_grad}
    if lora:  # the adapters and the score head (peft trains a classifier's head whole)
        assert trained and all("lora_" in n or "score" in n for n in trained)
        assert any("score" in n for n in trained)
    summary = job.fit()
    assert summary["val_end"]["val/loss"] < summary["val_start"]["val/loss"]
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith("global")) == \
        ["global_step_3", "global_step_6"]
