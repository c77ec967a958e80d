"""The reward-model job on a real DeepSpeed engine (tiny Llama classifier, one rank in this process): its loss is the
Bradley-Terry loss of a float64 loop over the pairs, the same however the pairs are split; it scores exactly as the
RL job's RewardModel; its export (full and LoRA) loads as reward.model_path and as AutoModelForSequenceClassification;
and it learns the parity task's ranking (held-out accuracy >= 0.9)."""
import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from verl_ds.stages.rm import RewardModelJob

from prefs_testutil import PAIRS, float64_model, gathered_state, log1p_exp, loop_rewards, make_job


def test_loss_is_bradley_terry_of_a_float64_loop(tmp_path):
    job = make_job(RewardModelJob, tmp_path, "actor.lr=1e-2")
    try:
        job.train_step()  # a trained score head: rewards far from 0, so the check means something
        items = list(job.train_set)
        assert len(items) == len(PAIRS) and job.units(items) == len(PAIRS)
        ref = float64_model(AutoModelForSequenceClassification, job.engine.module.config,
                            gathered_state(job.engine.module))
        rewards = loop_rewards(ref, items)
        want = sum(log1p_exp(-(c - r)) for c, r in rewards) / len(items)
        acc = sum(c > r for c, r in rewards)
        margin = sum(c - r for c, r in rewards)
        assert abs(margin) > 0.05
        norm = torch.tensor(float(len(items)), dtype=torch.float64)
        loss, parts = job.loss(items, norm)
        assert float(loss.detach()) == pytest.approx(want, rel=1e-5)
        assert float(parts["loss"].detach()) / len(items) == pytest.approx(want, rel=1e-5)
        assert float(parts["accuracy"]) == pytest.approx(acc) and float(parts["margin"]) == pytest.approx(margin, abs=1e-4)
        # split into micro-batches of 1, 3 and 4 pairs over the same normaliser: the shares add up
        split = sum(float(job.loss(g, norm)[0].detach()) for g in (items[:1], items[1:4], items[4:]))
        assert split == pytest.approx(want, rel=1e-5)
    finally:
        job.close()


def test_scores_as_the_rl_reward_model(tmp_path):
    from verl_ds.models.reward import RewardModel
    from verl_ds.stages.pairs import collate_pairs

    job = make_job(RewardModelJob, tmp_path)
    try:
        job.train_step()
        items = list(job.train_set)
        chosen, rejected = job.rewards(items)
        b = collate_pairs(items, job.tokenizer.pad_token_id)
        served = RewardModel(model=job.engine).get_reward(b["input_ids"], b["attention_mask"])
        torch.testing.assert_close(torch.cat([chosen, rejected]).detach(), served, atol=1e-6, rtol=0)
    finally:
        job.close()


@pytest.mark.parametrize("lora", [False, True])
def test_export_loads_as_reward_model_path(tmp_path, lora):
    from verl_ds.config import load_config
    from verl_ds.config.validate import validate
    from verl_ds.engines.build import build_reward_engine
    from verl_ds.models.reward import RewardModel
    from verl_ds.stages.pairs import collate_pairs

    extra = ["actor.lora_rank=4", "actor.lr=5e-2"] if lora else ["actor.lr=1e-2"]
    job = make_job(RewardModelJob, tmp_path, "trainer.total_steps=2", *extra)
    try:
        if lora:  # the default targets include output-head: the classifier's head trains whole instead
            names = [n for n, p in job.engine.module.named_parameters() if p.requires_grad]
            assert any("lora_A" in n for n in names) and any(n.endswith("score.modules_to_save.default.weight")
                                                               for n in names)
        summary = job.fit()
        items = list(job.train_set)
        b = collate_pairs(items, job.tokenizer.pad_token_id)
        trained = RewardModel(model=job.engine).get_reward(b["input_ids"], b["attention_mask"])
    finally:
        job.close()
    export = summary["export_dir"]
    assert export.endswith("hf_reward_model")
    plain = AutoModelForSequenceClassification.from_pretrained(export).eval()
    assert plain.config.num_labels == 1 and type(plain).__name__ == "LlamaForSequenceClassification"
    torch.testing.assert_close(RewardModel(model=plain).get_reward(b["input_ids"], b["attention_mask"]), trained,
                               atol=1e-5, rtol=0)
    # what the RL job does with reward.model_path
    cfg = load_config(None, [f"reward.model_path={export}", "reward.functions=[]", "deepspeed.zero_stage=0"])
    engine = build_reward_engine(cfg, validate(cfg), export)
    torch.testing.assert_close(RewardModel(model=engine).get_reward(b["input_ids"], b["attention_mask"]), trained,
                               atol=1e-5, rtol=0)


@pytest.mark.slow
def test_learns_the_parity_ranking_on_held_out_pairs(tmp_path):
    from verl_ds.config import load_config
    from verl_ds.dist import detect_launch

    cfg = load_config(None, [f"trainer.output_dir={tmp_path / 'run'}", "trainer.total_steps=30", "trainer.loggers=[]",
                             "data.num_train_prompts=1024", "data.num_val_prompts=128",
                             "actor.mini_batch_size=32", "actor.micro_batch_size=32", "trainer.export=none"])
    job = RewardModelJob(cfg, detect_launch({}))
    summary = job.fit()
    assert summary["val_start"]["val/accuracy"] < 0.7
    assert summary["val_end"]["val/accuracy"] >= 0.9, summary["val_end"]
    assert summary["val_end"]["val/margin"] > 1.0
    assert math.isfinite(summary["val_end"]["val/loss"])
