"""One process, plain (un-partitioned) modules: the pieces of weights/zero3.py, the replica and the export that do
not need ranks; their bad inputs are named. The 2-rank ZeRO-3 behaviour is in test_build_partitioned.py and
test_replica_export.py."""
import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from verl_ds.weights.replica import GenerationReplica
from verl_ds.weights.zero3 import copy_param, copy_params, persistent_buffers
from verl_ds.export import export_hf, parse_size


def _cfg(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=32, pad_token_id=0, eos_token_id=2, bos_token_id=1)
    return LlamaConfig(**{**base, **kw})


def test_copy_params_copies_everything_and_names_what_is_missing():
    torch.manual_seed(0)
    a, b = LlamaForCausalLM(_cfg()), LlamaForCausalLM(_cfg())
    assert copy_params(a, b) == len(list(b.parameters()))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(KeyError, match=r"the source has no parameter 'model.embed_tokens.weight' \(for destination"):
        copy_params(a.model, b)  # names without the causal LM's prefix
    with pytest.raises(ValueError, match=r"shapes differ: source \(97, 32\), destination \(32, 32\)"):
        copy_param(a.model.embed_tokens.weight, a.model.layers[0].self_attn.q_proj.weight)


def test_persistent_buffers_leave_out_rotary_caches():
    model = LlamaForCausalLM(_cfg())
    names = [n for n, _ in persistent_buffers(model)]
    assert "model.rotary_emb.inv_freq" in dict(model.named_buffers()) and "model.rotary_emb.inv_freq" not in names
    assert names == [n for n in model.state_dict() if n in dict(model.named_buffers())]


def test_plain_replica_refreshes_in_place_without_touching_the_rng():
    torch.manual_seed(0)
    source = LlamaForCausalLM(_cfg()).to(torch.bfloat16)
    state = torch.get_rng_state()
    rep = GenerationReplica(source)
    ptrs = [p.data_ptr() for p in rep.model.parameters()]
    rep.refresh()
    with torch.no_grad():
        for p in source.parameters():
            p.add_(1.0)
    rep.refresh()
    assert torch.equal(state, torch.get_rng_state())
    assert ptrs == [p.data_ptr() for p in rep.model.parameters()] and rep.refreshes == 2
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in rep.model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(source.parameters(), rep.model.parameters()))


def test_replica_whose_tying_differs_is_refused():
    source = LlamaForCausalLM(_cfg(tie_word_embeddings=False))
    source.config.tie_word_embeddings = True  # the config now says tied; the module is not
    with pytest.raises(ValueError, match=r"tied to another one that the source keeps separate"):
        GenerationReplica(source)
    source = LlamaForCausalLM(_cfg(tie_word_embeddings=True))
    source.config.tie_word_embeddings = False  # the other way: the replica would have a head nobody fills
    with pytest.raises(ValueError, match=r"the source has nothing for replica parameters \['lm_head.weight'\]"):
        GenerationReplica(source)


@pytest.mark.parametrize("tied", [True, False])
def test_export_at_world_size_one_round_trips(tmp_path, tied):
    torch.manual_seed(0)
    model = LlamaForCausalLM(_cfg(tie_word_embeddings=tied))
    (tmp_path / "model.safetensors").write_bytes(b"stale")  # an earlier export with another layout
    export_hf(model, None, str(tmp_path), max_shard_size="20KB")
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors" not in files and "model.safetensors.index.json" in files
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    expected = [n for n, _ in model.named_parameters()]  # a tied head once, under the embedding's name
    assert sorted(index["weight_map"]) == sorted(expected)
    assert ("lm_head.weight" in index["weight_map"]) != tied
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tied
    one = tmp_path / "one"
    export_hf(model, None, str(one))
    assert "model.safetensors" in os.listdir(one) and "model.safetensors.index.json" not in os.listdir(one)


@pytest.mark.parametrize("text,value", [("5GB", 5 * 10**9), ("512MiB", 512 * 2**20), (1234, 1234), ("1.5 kb", 1500)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["five", "5XB", 0, -3, True, "0MB"])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_size(bad)

