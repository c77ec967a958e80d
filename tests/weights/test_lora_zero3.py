"""LoRA actor and critic built by ``verl_ds.builder.build`` on real DeepSpeed engines (ZeRO stages 0-3, 1 and 2
ranks, gradient checkpointing): one actor engine and no reference engine; the reference (the actor with its
adapters off) scores exactly the base model's log-probs before and after updates; only the adapters (and the
critic's value head) train while the partitioned base stays unchanged; the generation replica holds the merged
weights after every refresh; the merged export (AutoModelForCausalLM) and the adapter export (peft on the base)
reproduce the policy."""
import pytest

from dist_testutil import run_ranks

pytest.importorskip("peft")

WORKER = r'''
import json, os, sys
import torch
from deepspeed.runtime.zero.partition_parameters import GatheredParameters
from verl_ds import dist as vdist
from verl_ds.builder import build
from verl_ds.config import load_config, validate
from verl_ds.weights import lora
from verl_ds.engines.build import build_actor_model, load_tokenizer
from verl_ds.export import export_adapter, export_hf
from verl_ds.models import ReferenceModel
from verl_ds.models.policy import AdaptersOffReferenceModel

out_dir, stages, gc = sys.argv[2], [int(s) for s in sys.argv[3].split(",")], sys.argv[4] == "1"
vdist.init_distributed(vdist.detect_launch(), 300, "cpu")
rank, world = vdist.rank(), vdist.world_size()
res = {}

def gathered(module, trainable):
    out = {}
    for name, p in module.named_parameters():
        if p.requires_grad == trainable:
            with GatheredParameters([p], modifier_rank=None):
                out[name] = p.detach().clone()
    return out

for stage in stages:
    r = res[str(stage)] = {}
    cfg = load_config(overrides=[
        "model.config_overrides.hidden_size=32", "model.config_overrides.intermediate_size=64", "data.num_train_prompts=32", "data.num_val_prompts=8",
        "rollout.batch_size=4", "actor.mini_batch_size=4", f"actor.micro_batch_size={4 // world}",
        f"deepspeed.zero_stage={stage}", f"model.gradient_checkpointing={str(gc).lower()}",
        "actor.lora_rank=4", "actor.lora_alpha=8", "actor.lora_target_modules=[q_proj, v_proj, down_proj]",
        "critic.lora_rank=2", "actor.lr=0.05", f"trainer.output_dir={out_dir}"])
    derived = validate(cfg, world)
    c = build(cfg, derived, rank, world, out_dir)
    actor = c.engines["actor"]
    r["engines"] = sorted(c.engines)
    ref = c.registry.get("ref")
    r["ref_class"] = type(ref).__name__
    r["ref_is_actor_engine"] = ref.lm is actor
    snap = {e["name"]: e for e in c.registry.snapshot()}
    r["ref_snapshot"] = [snap["ref"]["class"], snap["ref"]["trainable"], snap["ref"]["num_parameters"]]
    r["actor_snapshot"] = [snap["actor"]["trainable"], snap["actor"]["num_parameters"]]
    base_params = [p for p in actor.module.parameters() if not p.requires_grad]
    r["base_partitioned"] = all(hasattr(p, "ds_id") for p in base_params)
    r["trainable_actor"] = sorted(n for n, p in actor.module.named_parameters() if p.requires_grad)
    r["trainable_critic"] = sorted(n for n, p in c.engines["critic"].module.named_parameters() if p.requires_grad)
    r["counts"] = list(lora.count_parameters(actor.module))
    # the base model as a plain HF model: the same seeded init, no ZeRO, no adapters
    tok = load_tokenizer(cfg)
    base = build_actor_model(cfg, tok).eval()
    r["base_numel"] = sum(p.numel() for p in base.parameters())
    plain_ref = ReferenceModel(base)
    g = torch.Generator().manual_seed(7 + rank)
    obs = torch.randint(3, len(tok), (4, 12), generator=g)
    mask = torch.ones_like(obs, dtype=torch.bool)
    mask[0, :3] = False  # left padding
    R = 5
    policy = c.registry.get("actor")
    diffs, moved = [], []
    base_before = gathered(actor.module, trainable=False)
    adapters_before = gathered(actor.module, trainable=True)
    for step in range(3):
        with torch.no_grad():
            want = plain_ref.get_logprob(obs, obs[:, -R:], mask)
            got = ref.get_logprob(obs, obs[:, -R:], mask)
            own = policy.get_logprob(obs, obs[:, -R:], mask)
        diffs.append([float((got - want).abs().max()), float((own - want).abs().max())])
        for _ in range(derived.grad_accum):  # one optimizer step: raise the log-prob of the given tokens
            loss = -policy.get_logprob(obs[:4 // world], obs[:4 // world, -R:], mask[:4 // world]).mean()
            policy.update(None, {"loss": loss})
    r["ref_vs_base"] = diffs
    base_after = gathered(actor.module, trainable=False)
    adapters_after = gathered(actor.module, trainable=True)
    r["base_unchanged"] = all(torch.equal(base_before[k], base_after[k]) for k in base_before)
    r["adapters_moved"] = sum(not torch.equal(adapters_before[k], adapters_after[k]) for k in adapters_before)
    # the replica: the merged weights of the current adapters
    rollout = policy.rollout_engine
    rollout.refresh()
    with torch.no_grad():
        rep = rollout.replica(input_ids=obs, attention_mask=mask.long()).logits
        eng = actor(input_ids=obs, attention_mask=mask.long()).logits
    r["replica_vs_engine"] = float((rep - eng).abs().max())
    r["replica_is_plain"] = type(rollout.replica).__name__
    action, lp, _ = policy.get_action(obs[:, :7], mask[:, :7], max_new_tokens=4, greedy=True)
    r["generated"] = list(action.shape)
    rollout.gather_params = False  # generate on the peft model itself (per-token gathering under ZeRO-3)
    again, _, _ = policy.get_action(obs[:, :7], mask[:, :7], max_new_tokens=4, greedy=True)
    rollout.gather_params = True
    r["per_token_gen_equal"] = bool(torch.equal(again, action))
    # exports from the engine: merged (a plain HF model) and adapter (peft on the exported base)
    path = os.path.join(out_dir, f"adapter_{stage}")
    export_adapter(actor, tok, path)
    export_hf(actor, tok, os.path.join(out_dir, f"merged_{stage}"))
    if rank == 0:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(os.path.join(path, "base")), path)
        merged = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, f"merged_{stage}"))
        r["merged_class"] = type(merged).__name__
        with torch.no_grad():
            for key, model in (("adapter_export_vs_engine", loaded), ("merged_export_vs_engine", merged)):
                r[key] = float((model.eval()(input_ids=obs, attention_mask=mask.long()).logits - eng).abs().max())
    for e in c.engines.values():
        e.destroy()
json.dump(res, open(sys.argv[1] % rank, "w"))
'''


def check(res: dict, world: int) -> None:
    for stage, r in res.items():
        assert r["engines"] == ["actor", "critic"], stage  # no reference engine
        assert r["ref_class"] == "AdaptersOffReferenceModel" and r["ref_is_actor_engine"]
        assert r["ref_snapshot"] == ["AdaptersOffReferenceModel", False, r["base_numel"]]
        trainable, total = r["counts"]
        assert r["actor_snapshot"] == [True, total] and total > r["base_numel"]
        # 2 layers x (q, v, down) x (A, B), rank 4: q (32 -> 32), v (32 -> 16: 2 kv heads of 8), down (64 -> 32)
        assert len(r["trainable_actor"]) == 12 and all(".lora_" in n for n in r["trainable_actor"])
        assert trainable == 2 * 4 * ((32 + 32) + (32 + 16) + (64 + 32))
        assert total - trainable == r["base_numel"]
        assert r["base_partitioned"] == (stage == "3")
        assert "value_head.weight" in r["trainable_critic"] and "value_head.bias" in r["trainable_critic"]
        assert all(".lora_" in n or n.startswith("value_head.") for n in r["trainable_critic"])
        # head + 2 layers x the actor's 3 target modules (q_proj, v_proj, down_proj) x (A, B): the critic takes them
        assert len(r["trainable_critic"]) == 2 + 2 * 3 * 2
        ref_vs_base, policy_vs_base = zip(*r["ref_vs_base"])
        assert max(ref_vs_base) < 1e-5, r["ref_vs_base"]  # the reference is the base model, before and after updates
        assert policy_vs_base[0] < 1e-5 and min(policy_vs_base[1:]) > 1e-3, r["ref_vs_base"]  # B = 0 at the start
        assert r["base_unchanged"] and r["adapters_moved"] >= 6
        assert r["replica_vs_engine"] < 1e-4 and r["replica_is_plain"] == "LlamaForCausalLM"
        assert r["generated"] == [4, 4] and r["per_token_gen_equal"]
        if "adapter_export_vs_engine" in r:
            assert r["adapter_export_vs_engine"] < 1e-4 and r["merged_export_vs_engine"] < 1e-4
            assert r["merged_class"] == "LlamaForCausalLM"


def test_lora_zero_stages_one_rank_with_gradient_checkpointing(tmp_path):
    (res,) = run_ranks(WORKER, 1, tmp_path, args=[str(tmp_path), "0,2,3", "1"], timeout=900)
    assert sorted(res) == ["0", "2", "3"]
    check(res, 1)


def test_lora_zero3_two_ranks(tmp_path):
    results = run_ranks(WORKER, 2, tmp_path, args=[str(tmp_path), "3", "0"], timeout=900)
    for res in results:
        check(res, 2)
    assert "adapter_export_vs_engine" in results[0]["3"]
