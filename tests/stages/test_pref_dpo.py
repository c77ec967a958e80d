"""The DPO job on real DeepSpeed engines (tiny Llama, one rank in this process): its loss and metrics are DPO's on
the completions' log-probs of a float64 loop over the pairs (policy and frozen reference engine, packed or padded;
IPO on token means; reference-free), the same however the pairs are split; with LoRA the reference is the actor with
its adapters off (the initial model, no second engine)."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from verl_ds.stages.dpo import DPOJob

from prefs_testutil import PAIRS, float64_model, gathered_state, log1p_exp, loop_logps, make_job


def _dpo_loop(policy, ref, beta, ipo=False, free=False, eps=0.0):
    """The float64 loss mean and metric sums of DPO over (policy, reference) log-prob pairs."""
    loss, sums = 0.0, {"rewards/chosen": 0.0, "rewards/rejected": 0.0, "rewards/accuracies": 0.0,
                       "rewards/margins": 0.0, "logps/chosen": 0.0, "logps/rejected": 0.0}
    for (pc, pr), (rc, rr) in zip(policy, ref):
        rc, rr = (0.0, 0.0) if free else (rc, rr)
        x = (pc - pr) - (rc - rr)
        loss += (x - 1 / (2 * beta)) ** 2 if ipo else (1 - eps) * log1p_exp(-beta * x) + eps * log1p_exp(beta * x)
        c, r = beta * (pc - rc), beta * (pr - rr)
        for k, v in (("rewards/chosen", c), ("rewards/rejected", r), ("rewards/accuracies", float(c > r)),
                     ("rewards/margins", c - r), ("logps/chosen", pc), ("logps/rejected", pr)):
            sums[k] += v
    return loss / len(policy), sums


def _check(job, items, want, sums):
    n = len(items)
    norm = torch.tensor(float(n), dtype=torch.float64)
    loss, parts = job.loss(items, norm)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-5, abs=1e-7)
    for k, v in sums.items():
        assert float(parts[k]) == pytest.approx(v, rel=1e-5, abs=1e-5), k
    split = sum(float(job.loss(g, norm)[0].detach()) for g in (items[:1], items[1:4], items[4:]))
    assert split == pytest.approx(want, rel=1e-5, abs=1e-7)


@pytest.mark.parametrize("remove_padding", [True, False])
def test_loss_is_dpo_of_a_float64_loop(tmp_path, remove_padding):
    job = make_job(DPOJob, tmp_path, f"model.remove_padding={str(remove_padding).lower()}", "actor.lr=1e-2",
                   "dpo.beta=0.5", "dpo.label_smoothing=0.1")
    try:
        assert job.packed == remove_padding and set(job.engines) == {"actor", "ref"}
        items = list(job.train_set)
        config = job.engine.module.config
        ref = float64_model(AutoModelForCausalLM, config, gathered_state(job.engines["ref"].module))
        # at the start the policy is its reference: every implicit reward is 0 and the loss log 2
        _check(job, items, math.log(2), {"rewards/margins": 0.0, "rewards/accuracies": 0.0})
        job.train_step()
        job.train_step()
        policy = float64_model(AutoModelForCausalLM, config, gathered_state(job.engine.module))
        want, sums = _dpo_loop(loop_logps(policy, items), loop_logps(ref, items), beta=0.5, eps=0.1)
        assert sums["rewards/margins"] > 0.01  # trained: the policy now prefers the chosen completions
        _check(job, items, want, sums)
    finally:
        job.close()


def test_ipo_on_token_means_and_reference_free(tmp_path):
    job = make_job(DPOJob, tmp_path, "actor.lr=1e-2", "dpo.loss=ipo", "dpo.beta=0.5")
    try:
        job.train_step()
        items = list(job.train_set)
        config = job.engine.module.config
        ref = float64_model(AutoModelForCausalLM, config, gathered_state(job.engines["ref"].module))
        policy = float64_model(AutoModelForCausalLM, config, gathered_state(job.engine.module))
        want, sums = _dpo_loop(loop_logps(policy, items, average=True), loop_logps(ref, items, average=True),
                               beta=0.5, ipo=True)
        _check(job, items, want, sums)
    finally:
        job.close()
    (tmp_path / "free").mkdir()
    job = make_job(DPOJob, tmp_path / "free", "dpo.reference_free=true", "dpo.beta=0.3")
    try:
        assert set(job.engines) == {"actor"} and job.reference is None
        items = list(job.train_set)
        policy = float64_model(AutoModelForCausalLM, job.engine.module.config, gathered_state(job.engine.module))
        lp = loop_logps(policy, items)
        want, sums = _dpo_loop(lp, lp, beta=0.3, free=True)
        _check(job, items, want, sums)
    finally:
        job.close()


def test_lora_reference_is_the_actor_with_adapters_off(tmp_path):
    from verl_ds.models.policy import AdaptersOffReferenceModel
    from verl_ds.stages.pairs import collate_pairs

    job = make_job(DPOJob, tmp_path, "actor.lora_rank=4", "actor.lr=5e-2", "dpo.beta=0.5")
    try:
        assert set(job.engines) == {"actor"} and isinstance(job.reference, AdaptersOffReferenceModel)
        items = list(job.train_set)
        batch = collate_pairs(items, job.tokenizer.pad_token_id)
        with torch.no_grad():
            start = job.sequence_logps(job.policy, batch)
            ref_start = job.sequence_logps(job.reference, batch)
        torch.testing.assert_close(ref_start, start)  # B = 0: the adapters change nothing yet
        _check(job, items, math.log(2), {"rewards/margins": 0.0})
        for _ in range(3):
            job.train_step()
        with torch.no_grad():
            now = job.sequence_logps(job.policy, batch)
            ref_now = job.sequence_logps(job.reference, batch)
        torch.testing.assert_close(ref_now, start, atol=1e-5, rtol=0)  # the frozen base: the initial model
        assert float((now - start).abs().max()) > 1e-2
        n = len(items)
        margin = 0.5 * float(((now[:n] - ref_now[:n]) - (now[n:] - ref_now[n:])).sum())
        assert margin > 0  # the adapters moved the policy toward the chosen completions
    finally:
        job.close()


def _sampled_rule_score(model_dir, n=256, seed=777):
    """The parity rule's mean score of one response sampled (temperature 1) per held-out prompt."""
    from transformers import AutoTokenizer

    from verl_ds.tasks import parity

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    records = parity.generate_prompts(n, seed)
    enc = tok([r["prompt"] for r in records], return_tensors="pt", padding=True)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        gen = model.generate(**enc, do_sample=True, top_k=0, top_p=1.0, max_new_tokens=8,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1]:], skip_special_tokens=False)
    return sum(parity.score(t, r["target"]) for t, r in zip(texts, records)) / n


@pytest.mark.slow
def test_dpo_on_the_rule_ranked_pairs_raises_the_rule_score(tmp_path):
    """A briefly fine-tuned model (SFT, 12 steps: digits, either parity) trained with DPO on the built-in pairs
    samples responses the parity rule scores higher on held-out prompts (by >= 0.15; the pipeline measures ~0.2)."""
    from verl_ds.config import load_config
    from verl_ds.dist import detect_launch
    from verl_ds.stages.sft import SFTJob

    common = ["trainer.loggers=[]", "data.max_prompt_length=16",
              "rollout.max_new_tokens=8", "trainer.val_every=0"]
    sft = SFTJob(load_config(None, [*common, f"trainer.output_dir={tmp_path / 'sft'}", "trainer.total_steps=12"]),
                 detect_launch({})).fit()["export_dir"]
    dpo = DPOJob(load_config(None, [*common, f"trainer.output_dir={tmp_path / 'dpo'}", f"model.path={sft}",
                                    "trainer.total_steps=40", "data.num_train_prompts=2048"]),
                 detect_launch({})).fit()["export_dir"]
    before, after = _sampled_rule_score(sft), _sampled_rule_score(dpo)
    assert after - before >= 0.15, (before, after)
