"""LoRA through peft on plain HF models (no DeepSpeed): the config keys, target checks with hints, the adapters'
seeded init, the merged weights against a float64 reference, the adapters-off reference, GradOnlyDropout, and the
merged / adapter exports loaded back by transformers / peft."""
import json
import os

import pytest
import torch

pytest.importorskip("peft")

from verl_ds.config import ConfigError, load_config  # noqa: E402
from verl_ds.weights import lora  # noqa: E402
from verl_ds.weights.hf_weights import weight_groups  # noqa: E402
from verl_ds.export import export_adapter  # noqa: E402

VOCAB = 40


def tiny_llama(seed=0, tied=False):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=tied)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


def spec(rank=4, alpha=8.0, dropout=0.0, targets=("all-linear",), who="actor"):
    return lora.LoraSpec(rank=rank, alpha=alpha, dropout=dropout, target_modules=tuple(targets), who=who)


def randomize_adapters(model, seed=1, scale=0.2):
    """Give every adapter tensor non-zero values (B starts at 0: the merged model would equal the base)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


def ids(B=3, T=7, seed=2):
    return torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- config keys


def test_config_keys_default_off_and_flat():
    cfg = load_config(overrides=["actor.lora_rank=8", "actor.lora_target_modules=[q_proj, v_proj]"])
    assert lora.lora_spec(cfg, "critic") is None
    s = lora.lora_spec(cfg, "actor")
    assert (s.rank, s.alpha, s.dropout, s.target_modules) == (8, 16.0, 0.0, ("q_proj", "v_proj"))
    assert s.scaling == 2.0
    defaults = load_config()
    assert defaults.actor.lora_target_modules == ["all-linear", "output-head"]
    assert load_config().trainer.export == "merged"


def test_the_critic_takes_the_actors_lora_arguments_less_the_output_head():
    cfg = load_config(overrides=["critic.lora_rank=4", "actor.lora_alpha=8", "actor.lora_dropout=0.1"])
    s = lora.lora_spec(cfg, "critic")  # the actor's default targets are [all-linear, output-head]
    assert (s.rank, s.alpha, s.dropout, s.target_modules, s.who) == (4, 8.0, 0.1, ("all-linear",), "critic")
    assert lora.lora_spec(cfg, "actor") is None  # the actor's own rank is 0: full fine-tuning
    only_head = load_config(overrides=["critic.lora_rank=4", "actor.lora_target_modules=[output-head]"])
    with pytest.raises(ConfigError, match=r"critic.lora_rank=4: .* actor.lora_target_modules less 'output-head'"):
        lora.lora_spec(only_head, "critic")


@pytest.mark.parametrize("override, key, why", [
    ("actor.lora_rank=-1", "actor.lora_rank", "out of range"),
    ("critic.lora_rank=2.5", "critic.lora_rank", "expected int"),
    ("actor.lora_alpha=0", "actor.lora_alpha", "out of range"),
    ("actor.lora_dropout=1.0", "actor.lora_dropout", "out of range"),
    ("actor.lora_target_modules=q_proj", "actor.lora_target_modules", "expected list"),
    ("actor.lora_target_modules=['']", "actor.lora_target_modules", "must not be empty"),
    ("trainer.export=adaptor", "trainer.export", "did you mean 'adapter'"),
    ("actor.lora_rnak=8", "actor.lora_rnak", "did you mean 'lora_rank'"),
])
def test_bad_config_values_are_named(override, key, why):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=[override])
    assert key in str(err.value) and why in str(err.value)


def test_unknown_target_module_names_the_key_and_suggests():
    model = tiny_llama()
    with pytest.raises(ConfigError) as err:
        lora.resolve_target_modules(model, ["q_proj", "v_prj"], "actor")
    msg = str(err.value)
    assert "actor.lora_target_modules" in msg and "'v_prj'" in msg and "did you mean 'v_proj'" in msg
    assert "down_proj" in msg and "all-linear" in msg  # the model's adaptable names are listed
    linear = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]  # not the LM head
    assert lora.resolve_target_modules(model, ["all-linear"], "actor") == linear
    assert lora.resolve_target_modules(model, ["all-linear", "output-head"], "actor") == [*linear, "lm_head"]
    assert lora.resolve_target_modules(model, ["q_proj", "all-linear"], "actor") == linear
    with pytest.raises(ConfigError, match="at least one"):
        lora.resolve_target_modules(model, [], "actor")
    lora.resolve_target_modules(model, ["self_attn.q_proj", "lm_head", "embed_tokens"], "actor")  # suffixes are fine
    with pytest.raises(ConfigError, match=r"actor.lora_target_modules \(the critic's adapters\).*'mlp'"):  # a container is not adaptable
        lora.resolve_target_modules(model, ["mlp"], "critic")


# ---------------------------------------------------------------------------------------------- adapters


def test_apply_lora_freezes_base_seeds_adapters_and_leaves_the_rng():
    base = tiny_llama()
    before = torch.get_rng_state()
    a = lora.apply_lora(base, spec(targets=["q_proj", "v_proj"]), seed=5)
    assert torch.equal(torch.get_rng_state(), before)  # forked: a resumed run draws the same numbers
    b = lora.apply_lora(tiny_llama(), spec(targets=["q_proj", "v_proj"]), seed=5)
    c = lora.apply_lora(tiny_llama(), spec(targets=["q_proj", "v_proj"]), seed=6)
    trainable = {n for n, p in a.named_parameters() if p.requires_grad}
    # 2 layers x (q, v) x (A, B)
    assert len(trainable) == 8 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    for n in trainable:
        assert torch.equal(pa[n], pb[n])
        if ".lora_B." in n:
            assert not pa[n].any()  # B = 0: the wrapped model is exactly the base at the start
        else:
            assert not torch.equal(pa[n], pc[n])
    x = ids()
    with torch.no_grad():
        assert torch.equal(a(input_ids=x).logits, tiny_llama()(input_ids=x).logits)


def test_merged_weight_matches_a_float64_loop():
    model = lora.apply_lora(tiny_llama(), spec(rank=3, alpha=6.0, targets=["o_proj"]), seed=0)
    randomize_adapters(model)
    groups = weight_groups(model)
    outs = {name: produce for _, group in groups for name, _, _, produce in group}
    layer = model.get_base_model().model.layers[1].self_attn.o_proj
    W = layer.base_layer.weight.detach().double()
    A, B = layer.lora_A["default"].weight.detach().double(), layer.lora_B["default"].weight.detach().double()
    expected = W.clone()
    for i in range(W.shape[0]):
        for j in range(W.shape[1]):
            expected[i, j] += sum(B[i, k] * A[k, j] for k in range(3)) * (6.0 / 3)
    got = outs["model.layers.1.self_attn.o_proj.weight"]()
    torch.testing.assert_close(got.double(), expected, rtol=0, atol=1e-6)
    # plain HF names only, every base parameter once
    names = [n for _, group in groups for n, *_ in group]
    assert names == [n for n, _ in tiny_llama().named_parameters()]


def test_output_head_symbol(caplog):
    from transformers import LlamaModel

    tied = tiny_llama(tied=True)
    with caplog.at_level("WARNING", logger="verl_ds.weights.lora"):
        got = lora.resolve_target_modules(tied, ["all-linear", "output-head"], "actor")
    assert "lm_head" not in got and "o_proj" in got
    assert "output head 'lm_head' is tied to ['model.embed_tokens']" in caplog.text
    with pytest.raises(ConfigError, match=r"actor.lora_target_modules: \['output-head'\] leaves no module"):
        lora.resolve_target_modules(tied, ["output-head"], "actor")
    backbone = LlamaModel(tiny_llama().config)  # a critic's backbone: no LM head
    with pytest.raises(ConfigError, match=r"actor.lora_target_modules \(the critic's adapters\): 'output-head': the critic model has no output"):
        lora.resolve_target_modules(backbone, ["all-linear", "output-head"], "critic")
    wrapped = lora.apply_lora(tiny_llama(), spec(targets=["all-linear", "output-head"]), seed=0)
    assert isinstance(wrapped.get_output_embeddings(), lora._lora_layer_class())


def test_weight_groups_respect_disabled_adapters_and_tied_heads():
    with pytest.raises(ConfigError, match="'lm_head'.*tied to \\['model.embed_tokens'\\]"):
        lora.apply_lora(tiny_llama(tied=True), spec(targets=["q_proj", "lm_head"]), seed=0)
    with pytest.raises(ConfigError, match="'embed_tokens'.*tied to \\['lm_head'\\]"):
        lora.apply_lora(tiny_llama(tied=True), spec(targets=["embed_tokens"]), seed=0)
    model = lora.apply_lora(tiny_llama(tied=True), spec(targets=["q_proj", "o_proj"]), seed=0)
    randomize_adapters(model)
    base = tiny_llama(tied=True)
    with lora.adapters_off(model):
        values = {n: produce() for _, group in weight_groups(model) for n, _, _, produce in group}
    assert values.keys() == dict(base.named_parameters()).keys()  # the tied head once, under the embedding
    for n, p in base.named_parameters():
        assert torch.equal(values[n], p), n
    with pytest.raises(TypeError, match="expected a peft model"):
        lora.adapters_off(base)


def test_grad_only_dropout():
    model = lora.apply_lora(tiny_llama(), spec(dropout=0.5), seed=0)
    drops = [m for m in model.modules() if isinstance(m, lora.GradOnlyDropout)]
    assert drops and all(d.p == 0.5 for d in drops)
    model.train()
    x = torch.ones(4, 1000)
    with torch.no_grad():
        assert torch.equal(drops[0](x), x)
    y = drops[0](x.requires_grad_())
    assert (y == 0).any() and torch.allclose(y[y != 0], torch.full_like(y[y != 0], 2.0))


# ---------------------------------------------------------------------------------------------- reference


def test_adapters_off_reference_scores_the_base_model():
    from verl_ds.models import PolicyModel
    from verl_ds.models.policy import AdaptersOffReferenceModel, ReferenceModel

    base = tiny_llama()
    model = lora.apply_lora(tiny_llama(), spec(), seed=0)
    randomize_adapters(model)
    ref, actor, plain = AdaptersOffReferenceModel(model), PolicyModel(model), ReferenceModel(base)
    x = ids(B=2, T=9)
    R = 4
    with torch.no_grad():
        ref_lp = ref.get_logprob(x, x[:, -R:])
        base_lp = plain.get_logprob(x, x[:, -R:])
        actor_lp = actor.get_logprob(x, x[:, -R:])
        # float64 reference: log softmax of the base model's logits at the positions predicting the response
        logits = base(input_ids=x).logits.double()[:, -R - 1:-1]
        expected = torch.log_softmax(logits, -1).gather(-1, x[:, -R:, None]).squeeze(-1)
    torch.testing.assert_close(ref_lp.double(), expected, rtol=0, atol=1e-5)
    assert torch.equal(ref_lp, base_lp)
    assert (actor_lp - ref_lp).abs().max() > 1e-3  # the actor does use its adapters
    assert not any(m.base_model.model.model.layers[0].self_attn.q_proj.disable_adapters for m in [model])
    with pytest.raises(TypeError, match="peft model with LoRA adapters"):
        AdaptersOffReferenceModel(base)


# ---------------------------------------------------------------------------------------------- exports


def test_export_merged_loads_as_a_plain_model_with_the_policy_outputs(tmp_path):
    from transformers import AutoModelForCausalLM

    from verl_ds.export import export_hf

    model = lora.apply_lora(tiny_llama(), spec(targets=["q_proj", "down_proj", "lm_head"]), seed=0)
    randomize_adapters(model)
    export_hf(model, None, str(tmp_path / "merged"))
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert not any("lora" in n or "base_layer" in n for n, _ in loaded.named_parameters())
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, model(input_ids=x).logits, rtol=1e-5, atol=1e-5)


def test_export_adapter_with_and_without_a_base_path(tmp_path):
    from peft import PeftModel

    model = lora.apply_lora(tiny_llama(), spec(rank=2, targets=["k_proj", "up_proj"]), seed=0)
    randomize_adapters(model)
    x = ids()
    with torch.no_grad():
        want = model(input_ids=x).logits
    # a model built from config: its frozen base is written beside the adapters
    out = export_adapter(model, None, str(tmp_path / "adapter"))
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["r"] == 2 and cfg["base_model_name_or_path"] == os.path.abspath(os.path.join(out, "base"))
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(os.path.join(out, "base"))
    loaded = PeftModel.from_pretrained(base, out).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=x).logits, want, rtol=1e-6, atol=1e-6)
    # a base on disk: recorded, not copied
    out2 = export_adapter(model, None, str(tmp_path / "adapter2"), base_model_path="/models/base")
    assert not os.path.exists(os.path.join(out2, "base"))
    assert json.load(open(os.path.join(out2, "adapter_config.json")))["base_model_name_or_path"] == "/models/base"
    with pytest.raises(TypeError, match="no LoRA adapters"):
        export_adapter(tiny_llama(), None, str(tmp_path / "x"))


def test_export_actor_dispatches_on_the_format(tmp_path):
    from verl_ds.export import export_actor

    model = lora.apply_lora(tiny_llama(), spec(rank=2, targets=["q_proj"]), seed=0)
    export_actor(model, None, str(tmp_path / "m"))
    assert os.path.isfile(tmp_path / "m" / "model.safetensors") and not os.path.exists(tmp_path / "m" / "base")
    export_actor(model, None, str(tmp_path / "a"), fmt="adapter", base_model_path="/base")
    assert os.path.isfile(tmp_path / "a" / "adapter_model.safetensors")
    assert not os.path.exists(tmp_path / "a" / "model.safetensors")
    with pytest.raises(ValueError, match="expected one of .*'merged', 'adapter'.*got 'lora'"):
        export_actor(model, None, str(tmp_path / "x"), fmt="lora")


def test_fused_lm_head_refuses_an_adapted_head():
    lora.check_fused_head(lora.apply_lora(tiny_llama(), spec(), seed=0))  # all-linear leaves the head out
    with pytest.raises(ConfigError, match="model.fused_lm_head.*actor.lora_target_modules"):
        lora.check_fused_head(lora.apply_lora(tiny_llama(), spec(targets=["all-linear", "output-head"]), seed=0))


@pytest.mark.parametrize("remove_padding, fused_lm_head", [(True, False), (True, True)])
def test_packed_and_fused_paths_score_a_lora_actor_and_its_reference(remove_padding, fused_lm_head):
    """The packed (varlen attention) and fused-LM-head forwards give the padded path's log-probs, for the actor
    (adapters on) and the adapters-off reference (the base model)."""
    from verl_ds.models import PolicyModel, ReferenceModel
    from verl_ds.models.policy import AdaptersOffReferenceModel
    from verl_ds.models.varlen_attention import use_varlen_attention

    head = [] if fused_lm_head else ["output-head"]  # the fused head refuses adapters on the head (tested above)
    model = lora.apply_lora(tiny_llama(), spec(targets=["q_proj", "v_proj", "down_proj", *head]), seed=0)
    randomize_adapters(model)
    x = ids(B=3, T=10)
    mask = torch.ones_like(x, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, :2] = False
    R = 4
    with torch.no_grad():
        want_actor = PolicyModel(model).get_logprob(x, x[:, -R:], mask)
        want_ref = ReferenceModel(tiny_llama()).get_logprob(x, x[:, -R:], mask)
        if remove_padding:
            use_varlen_attention(model)
        kw = dict(remove_padding=remove_padding, fused_lm_head=fused_lm_head)
        got_actor = PolicyModel(model, **kw).get_logprob(x, x[:, -R:], mask)
        got_ref = AdaptersOffReferenceModel(model, **kw).get_logprob(x, x[:, -R:], mask)
    rm = x[:, -R:] >= 0  # every response column is a real token here
    torch.testing.assert_close(got_actor[rm], want_actor[rm], rtol=0, atol=2e-5)
    torch.testing.assert_close(got_ref[rm], want_ref[rm], rtol=0, atol=2e-5)
    assert (want_actor - want_ref).abs().max() > 1e-3


def test_v1_models_shows_the_reference_as_the_actor_with_adapters_off():
    """A LoRA run registers no reference model of its own: /v1/models (a real server on 127.0.0.1) lists the
    reference as the adapters-off view of the actor's peft model, frozen, counting only the base weights."""
    import urllib.request

    from verl_ds.models import PolicyModel
    from verl_ds.models.policy import AdaptersOffReferenceModel
    from verl_ds.registry import ModelRegistry
    from verl_ds.server import ControlServer
    from verl_ds.state import SharedState

    model = lora.apply_lora(tiny_llama(), spec(), seed=0)
    base_params = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    adapter_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    registry = ModelRegistry()
    registry.register("actor", PolicyModel(model))
    registry.register("ref", AdaptersOffReferenceModel(model))
    srv = ControlServer(SharedState(rank=0), registry, host="127.0.0.1", port=0)
    url = srv.start()
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
            entries = {e["id"]: e for e in json.loads(r.read())["data"]}
    finally:
        srv.stop()
    ref = entries["ref"]
    assert (ref["role"], ref["class"], ref["trainable"]) == ("ref", "AdaptersOffReferenceModel", False)
    assert ref["num_parameters"] == base_params and adapter_params > 0
    assert entries["actor"]["trainable"] is True
