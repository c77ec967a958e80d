"""Model families and packed rows / shared prompts / shared generation: every causal-LM family the installed
transformers ships, built tiny, gets log-probs equal to each sequence run alone (float64), or is refused by name at
start-up (``verl_ds.models.families.packing_support``); and the families of issue 30 one by one: StableLM and Nemotron
(the shared-prompt layout never reaches their attention), DeepSeek-V2 (MLA: value heads narrower than query heads),
LFM2 and Falcon-H1 (hybrid caches: plain generate), Mistral with a sliding window (shared, the window counted in each
sequence's positions). docs/models.md is this test's result."""
import logging
import os
import sys

import pytest
import torch

from families_testutil import tiny_family_lm
from packing_testutil import per_sequence_reference
from verl_ds.generation import HFRolloutEngine
from verl_ds.models import PolicyModel
from verl_ds.generation import shared_generation_refusal
from verl_ds.models.families import packing_support
from verl_ds.models.packed_forward import packed_logprobs
from verl_ds.models.varlen_attention import PackedRowNotReached, use_varlen_attention
from verl_ds.packing import pack
from verl_ds.prompt_sharing import pack_shared_prompts


@pytest.fixture(autouse=True)
def _one_thread():  # tiny models: OpenMP spin-waiting on a loaded 2-core machine costs more than it gives
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def grouped_batch(prompts, responses, P, R):
    """(observation (B, P + R), mask): left-padded prompts, right-padded responses."""
    obs = torch.zeros(len(responses), P + R, dtype=torch.long)
    mask = torch.zeros_like(obs, dtype=torch.bool)
    for b, (p, r) in enumerate(zip(prompts, responses)):
        obs[b, P - len(p):P], mask[b, P - len(p):P] = torch.tensor(p), True
        obs[b, P:P + len(r)], mask[b, P:P + len(r)] = torch.tensor(r, dtype=torch.long), True
    return obs, mask


def family_batch(seed=0):
    """Two prompts of 5 and 3 tokens, five samples: the first prompt's share one or two leading response tokens."""
    g = torch.Generator().manual_seed(seed)
    tok = [lambda n: torch.randint(3, 256, (n,), generator=g).tolist()][0]
    pa, pb, x = tok(5), tok(3), tok(3)
    return grouped_batch([pa, pa, pb, pa, pb], [x + tok(2), x[:2] + tok(1), tok(4), tok(3), tok(2)], P=5, R=5)


def _all_families():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


KINDS = (  # a refusal's message -> its short name in docs/models.md, first match wins
    ("use_attention", "own attention code"),
    ("does not support an attention implementation", "own attention code"),
    ("convolves over the sequence", "state-space / convolution layers"),
    ("carry a state along the sequence", "state-space / convolution layers"),
    ("linear-attention or state-space layers", "state-space / linear-attention cache"),
    ("attention calls for", "layers without attention"), ("not causal", "not causal"),
    ("does not depend on the position ids", "counts positions itself"),
    ("did not reach", "layout does not reach attention"),
    ("sliding window", "sliding window"), ("chunked attention", "chunked attention"),
    ("shared-generation probe", "shared generation fails"), ("probe forward failed", "probe forward fails"),
)


def _kind(refusal: str | None) -> str:
    if refusal is None:
        return "yes"
    return "no: " + next((name for key, name in KINDS if key in refusal), "other")


def _generation_check(lm, model_type: str) -> str:
    """Sampled tokens with shared prefill + decoding equal those of plain ``generate`` (the same seed), or the engine
    refuses sharing by name."""
    why = shared_generation_refusal(lm)
    if why is not None:
        assert model_type in why, why
        return _kind(why)
    # unpadded prompts: with left padding some families' own generate counts positions over the pads (Whisper's
    # decoder), where the shared path and the trainer's scoring use the real tokens' positions
    prompts = torch.tensor([[6, 7, 8, 9], [6, 7, 8, 9], [5, 6, 4, 3], [5, 6, 4, 3]])
    mask = torch.ones_like(prompts)
    out = {}
    for share in (False, True):
        engine = HFRolloutEngine(lm, pad_token_id=0, eos_token_id=2, gather_params=False, share_prefill=share)
        torch.manual_seed(5)
        try:
            out[share] = engine.generate(prompts, mask, max_new_tokens=4).responses
        except Exception as exc:  # noqa: BLE001
            if not share:  # plain generate itself fails for this tiny build: nothing to compare against
                return f"untestable: generate fails ({type(exc).__name__})"
            raise
    assert torch.equal(out[True], out[False]), f"{model_type}: shared generation drew other tokens"
    return "yes"


def family_status(model_type: str) -> tuple[str, str, str]:
    """(packed rows, shared prompts, shared generation) for ``model_type`` built tiny, as docs/models.md lists them;
    asserts that what is supported equals each sequence alone and that every refusal names the family."""
    try:
        lm = tiny_family_lm(model_type)
        obs, mask = family_batch()
        with torch.no_grad():
            ref, _, _ = per_sequence_reference(lm, None, obs, mask, 5, 1.0)
    except Exception as exc:  # noqa: BLE001 - a family whose defaults do not shrink, or that needs more than ids
        pytest.skip(f"{model_type} cannot run tiny here ({type(exc).__name__}: {str(exc)[:160]})")
    R, rmask = 5, mask[:, -5:]
    support = packing_support(lm, max_length=obs.shape[1])
    cases = (("packed", pack(obs, mask, R), support.packing),
             ("shared prompts", pack_shared_prompts(obs, mask, R), support.sharing),
             ("shared prefixes", pack_shared_prompts(obs, mask, R, share_prefixes=True), support.sharing))
    for what, packed, refused in cases:
        if refused is not None:
            assert model_type in refused, refused  # refused by name
            continue
        with torch.no_grad():
            lp, _ = packed_logprobs(lm, packed, R)
        torch.testing.assert_close(lp.double() * rmask, ref * rmask, atol=2e-5, rtol=1e-4,
                                   msg=lambda m: f"{model_type} {what}: {m}")
    sharing = "no: packing refused" if support.packing is not None else _kind(support.sharing)
    return _kind(support.packing), sharing, _generation_check(lm, model_type)


MODELS_MD = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "models.md")


def documented_statuses() -> dict:
    """docs/models.md's table: model_type -> (packed rows, shared prompts, shared generation)."""
    rows = {}
    with open(MODELS_MD) as fh:
        for line in fh:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if line.startswith("| `") and len(cells) == 4:
                rows[cells[0].strip("`")] = tuple(cells[1:])
    return rows


@pytest.mark.slow
@pytest.mark.parametrize("model_type", _all_families())
def test_every_causal_lm_family_equals_each_sequence_alone_or_is_refused_by_name(model_type):
    """docs/models.md says what every family gets; regenerate its table with
    ``.venv/bin/python tests/models/test_families.py`` after a transformers upgrade."""
    try:
        status = family_status(model_type)
    except pytest.skip.Exception as exc:
        assert documented_statuses().get(model_type, ("untestable here",))[0] == "untestable here", model_type
        raise exc
    assert documented_statuses().get(model_type) == status, (model_type, status)


# ---- the families of issue 30, one by one -------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", ["stablelm", "nemotron"])
def test_layers_that_drop_attention_kwargs_refuse_shared_prompts_by_name(model_type):
    """StableLM's and Nemotron's decoder layers call their attention without the forward's keyword arguments: the
    shared-prompt layout never arrives, and the attention would split the row where position ids restart (every
    response after the first of a group attended without its prompt). A shared forward raises instead, naming the
    family; the start-up decision refuses sharing but keeps plain packing, which stays exact."""
    lm = use_varlen_attention(tiny_family_lm(model_type, seed=1))
    obs, mask = family_batch(1)
    R = 5
    model = PolicyModel(lm, remove_padding=True, share_prompts=True)
    with torch.no_grad(), pytest.raises(PackedRowNotReached, match=rf"shared prompts: {model_type} .*the row's "
                                                                    r"layout did not reach 2 of its 2 attention calls"):
        model.get_logprob(obs, obs[:, -R:], mask)
    support = packing_support(lm, max_length=obs.shape[1])
    assert support.packing is None and model_type in support.sharing
    ref, _, _ = per_sequence_reference(lm, None, obs, mask, R, 1.0)
    lp = PolicyModel(lm, remove_padding=True).get_logprob(obs, obs[:, -R:], mask)
    rmask = mask[:, -R:]
    torch.testing.assert_close(lp.double() * rmask, ref.detach() * rmask, atol=1e-5, rtol=1e-5)


def test_mla_value_heads_narrower_than_query_heads_in_the_explicit_path():
    """DeepSeek-V2's multi-head latent attention: query/key heads of qk_nope + qk_rope = 16, value heads of 8; the
    small no-grad calls take the explicit CPU path, which shaped its output by the query's head size."""
    lm = tiny_family_lm("deepseek_v2", seed=2)
    assert lm.config.qk_nope_head_dim + lm.config.qk_rope_head_dim != lm.config.v_head_dim
    obs, mask = family_batch(2)
    R, rmask = 5, mask[:, -5:]
    with torch.no_grad():
        ref, _, _ = per_sequence_reference(lm, None, obs, mask, R, 1.0)
        use_varlen_attention(lm)
        for share in (False, True):
            lp = PolicyModel(lm, remove_padding=True, share_prompts=share).get_logprob(obs, obs[:, -R:], mask)
            torch.testing.assert_close(lp.double() * rmask, ref * rmask, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("model_type", ["lfm2", "falcon_h1"])
def test_hybrid_models_generate_plainly_with_a_log_line(model_type, caplog):
    """LFM2 (short convolutions) and Falcon-H1 (Mamba in parallel with attention) keep state the shared prefill's and
    shared decoding's row copies do not follow (they crashed): the engine falls back to plain ``generate`` when built,
    saying so, and samples what an engine built without sharing samples."""
    lm = tiny_family_lm(model_type, seed=3)
    assert model_type in shared_generation_refusal(lm)
    prompts = torch.tensor([[0, 7, 8, 9], [0, 7, 8, 9], [5, 6, 4, 3], [5, 6, 4, 3]])
    mask = torch.tensor([[0, 1, 1, 1]] * 2 + [[1, 1, 1, 1]] * 2)
    out = {}
    for share in (True, False):
        with caplog.at_level(logging.WARNING, logger="verl_ds.generation"):
            caplog.clear()
            engine = HFRolloutEngine(lm, pad_token_id=0, eos_token_id=2, gather_params=False, share_prefill=share)
        said = [r.getMessage() for r in caplog.records if "rollout.share:" in r.getMessage()]
        assert len(said) == int(share) and not engine.share_prefill and not engine.share_decode
        if share:
            assert model_type in said[0] and "plain generate is used" in said[0]
        torch.manual_seed(11)
        out[share] = engine.generate(prompts, mask, max_new_tokens=4, temperature=1.0)
    assert torch.equal(out[True].responses, out[False].responses)
    assert packing_support(lm, max_length=16).packing is not None  # and no packed rows for it either


@pytest.mark.parametrize("window", [10, 4])
def test_sliding_windows_share_prompts_in_each_sequences_positions(window):
    """Mistral with a sliding window: the longest sequence of the batch is 9 fed tokens (5-token prompt, 4 fed
    response tokens). A window of 10 covers every sequence, one of 4 does not; either way shared prompts and prefixes
    equal each sequence alone (the window is part of the layout, counted in each sequence's own positions)."""
    lm = use_varlen_attention(tiny_family_lm("mistral", seed=4, sliding_window=window))
    obs, mask = family_batch(4)
    R, rmask = 5, mask[:, -5:]
    support = packing_support(lm, max_length=obs.shape[1])
    assert support.packing is None and support.sharing is None
    with torch.no_grad():
        ref, _, _ = per_sequence_reference(lm, None, obs, mask, R, 1.0)
        for share, prefixes in ((False, False), (True, False), (True, True)):
            lp = PolicyModel(lm, remove_padding=True, share_prompts=share,
                             share_prefixes=prefixes).get_logprob(obs, obs[:, -R:], mask)
            torch.testing.assert_close(lp.double() * rmask, ref * rmask, atol=1e-5, rtol=1e-5)


BUILD_WORKER = r'''
import json, logging, os, sys
import torch
from verl_ds import dist as vdist
from verl_ds.builder import build
from verl_ds.config import load_config, validate
from verl_ds.models import ReferenceModel

out_dir, model_dir = sys.argv[2], sys.argv[3]
os.makedirs(out_dir, exist_ok=True)
vdist.init_distributed(vdist.detect_launch(), 300, "cpu")
rank, world = vdist.rank(), vdist.world_size()
lines = []
handler = logging.Handler()
handler.emit = lambda record: lines.append(record.getMessage())
logging.getLogger("verl_ds").addHandler(handler)
cfg = load_config(overrides=[
    f"model.path={model_dir}", "data.num_train_prompts=16", "data.num_val_prompts=4", "rollout.batch_size=4",
    "rollout.n=2", "actor.mini_batch_size=4", f"actor.micro_batch_size={4 // world}", "deepspeed.zero_stage=3",
    "algo.kl_coef=0.1", f"trainer.output_dir={out_dir}"])
c = build(cfg, validate(cfg, world), rank, world, out_dir)
actor, ref = c.registry.get("actor"), c.registry.get("ref")
g = torch.Generator().manual_seed(5)
obs = torch.randint(3, len(c.tokenizer), (4, 10), generator=g)
obs[1, :6], obs[3, :6] = obs[0, :6], obs[2, :6]  # two prompts of 6 tokens, two samples each
mask = torch.ones_like(obs, dtype=torch.bool)
with torch.no_grad():
    got = actor.get_logprob(obs, obs[:, -4:], mask)
    want = ReferenceModel(c.engines["actor"]).get_logprob(obs, obs[:, -4:], mask)  # padded batches
res = {"packed": actor._remove_padding, "shared": [actor.shares_prompts, ref.shares_prompts],
       "lines": [l for l in lines if "model.share_prompts" in l or "model.remove_padding" in l],
       "diff": float((got - want).abs().max())}
for e in c.engines.values():
    e.destroy()
json.dump(res, open(sys.argv[1] % rank, "w"))
'''


@pytest.mark.slow
def test_the_builder_falls_back_to_unshared_packing_for_stablelm_under_zero3_on_two_ranks(tmp_path):
    """A StableLM checkpoint with model.share_prompts on (the default) and rollout.n=2: the start-up probe (one tiny
    forward of each engine, on both ranks, under ZeRO-3) refuses shared prompts for the actor and the reference with
    one log line naming the family, keeps packed rows, and those equal the padded path."""
    from dist_testutil import run_ranks
    from transformers import StableLmConfig, StableLmForCausalLM

    from verl_ds.tasks import parity
    from verl_ds.tokenizer import build_tokenizer

    tok = build_tokenizer(parity.VOCAB)
    cfg = StableLmConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    StableLmForCausalLM(cfg).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    results = run_ranks(BUILD_WORKER, 2, tmp_path, args=[str(tmp_path / "run"), str(model_dir)], timeout=600)
    for rank, res in enumerate(results):
        assert res["packed"] and res["shared"] == [False, False], res
        assert res["diff"] < 1e-5, res
    (line,) = results[0]["lines"]
    assert line.startswith("model.share_prompts: the actor cannot share prompts (stablelm (StableLmForCausalLM)")
    assert line.endswith("packed rows without shared prompts are used")
    assert results[1]["lines"] == []  # said once, by rank 0


if __name__ == "__main__":  # print docs/models.md's table for the installed transformers
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    print("| family | packed rows | shared prompts | shared generation |\n|---|---|---|---|")
    for name in _all_families():
        try:
            cells = family_status(name)
        except pytest.skip.Exception as exc:
            why = " ".join(str(exc).split(" here (")[-1].split())  # one line, for the Markdown table
            why = why[:-1] if why.endswith(")") else why
            cells = ("untestable here", why[:90].replace("|", "/"), "")
        print(f"| `{name}` | " + " | ".join(cells) + " |", file=sys.stdout, flush=True)
