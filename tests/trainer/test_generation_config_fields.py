"""A checkpoint's generation_config.json changes nothing the HF rollout draws, on every path: plain ``generate``
(one rank, and the path every rank takes under ``synced_gpus``), the shared prefill followed by ``generate``, and
shared decoding. One test per GenerationConfig field (the fields of
https://huggingface.co/docs/transformers/main_classes/text_generation#transformers.GenerationConfig that add a
logits processor, a warper, a stopping criterion or another decoding mode, or change the output's form): a tiny model
saved with a generation_config.json setting that field draws, from the same seed, exactly the tokens, lengths and
log-probs the same weights draw with no such field (whose log-probs are the trainer's: test_rollout.py)."""
import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from verl_ds.generation import HFRolloutEngine
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

# field: a value a checkpoint could carry, each chosen so that applying it changes the draws of this tiny model
# (a vocabulary of 18: <pad> 0, <eos> 1, <bos> 2, <unk> 3, digits 4-13, even, odd, ':', '=>')
FIELDS = {
    "suppress_tokens": [4, 5, 6, 7, 8, 9],
    "begin_suppress_tokens": [4, 5, 6, 7, 8, 9],
    "bad_words_ids": [[4], [5], [6], [7]],
    "sequence_bias": [[[5], 8.0]],
    "min_length": 40,
    "min_new_tokens": 5,
    "min_p": 0.5,
    "top_h": 0.5,
    "typical_p": 0.5,
    "epsilon_cutoff": 0.05,
    "eta_cutoff": 0.05,
    "repetition_penalty": 3.0,
    "no_repeat_ngram_size": 1,
    "forced_eos_token_id": 9,
    "exponential_decay_length_penalty": [1, 4.0],
    "guidance_scale": 3.0,
    "watermarking_config": {"bias": 8.0, "greenlist_ratio": 0.25},
    "stop_strings": ["5"],
    "max_time": 0.0,
    "num_return_sequences": 2,
    "return_dict_in_generate": True,
    "prompt_lookup_num_tokens": 2,
    "top_k": 2,
    "top_p": 0.3,
    "temperature": 0.3,
}
PATHS = {  # name: HFRolloutEngine switches
    "plain_generate": dict(share_prefill=False),
    "shared_prefill_then_generate": dict(share_prefill=True, share_decode=False),
    "shared_decoding": dict(share_prefill=True, share_decode=True),
}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(parity.VOCAB)


@pytest.fixture(scope="module")
def neutral_dir(tmp_path_factory, tok):
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        model.lm_head.weight.mul_(5.0)  # a spread next-token distribution: truncations and penalties show
    path = tmp_path_factory.mktemp("neutral")
    model.save_pretrained(path)
    return path


def _draw(model, tok, path: str):
    enc = tok(["even : 1 2 =>"] * 6 + ["odd : 3 =>"] * 6, return_tensors="pt", padding=True)
    engine = HFRolloutEngine(model, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                             bos_token_id=tok.bos_token_id, gather_params=False, **PATHS[path])
    torch.manual_seed(7)
    return engine.generate(enc["input_ids"], enc["attention_mask"].bool(), max_new_tokens=6, temperature=1.0,
                           top_k=0, top_p=1.0)


@pytest.mark.parametrize("field", list(FIELDS))
def test_checkpoint_generation_config_field_changes_no_path(field, tok, neutral_dir, tmp_path):
    ckpt = tmp_path / field
    shutil.copytree(neutral_dir, ckpt)
    gen_json = ckpt / "generation_config.json"
    saved = json.loads(gen_json.read_text())
    saved.update({"do_sample": True, field: FIELDS[field]})
    gen_json.write_text(json.dumps(saved))
    loaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    assert getattr(loaded.generation_config, field) is not None  # the checkpoint carries the field
    neutral = AutoModelForCausalLM.from_pretrained(neutral_dir).eval()
    for path in PATHS:
        want, got = _draw(neutral, tok, path), _draw(loaded, tok, path)
        assert torch.equal(got.responses, want.responses), (path, got.responses, want.responses)
        assert torch.equal(got.response_length, want.response_length), path
        torch.testing.assert_close(got.log_probs, want.log_probs, atol=0, rtol=0, msg=lambda m: f"{path}: {m}")
    # the checkpoint's own generation config is left as it was
    assert getattr(loaded.generation_config, field) is not None


def test_a_peft_models_base_checkpoint_config_changes_nothing(tok, neutral_dir, tmp_path):
    """With LoRA and ``rollout.gather_params=false``, ``generate`` runs on the peft model, whose base model reads its
    own generation config: the checkpoint's suppress_tokens must not reach it either (fresh adapters change no
    logits, so the draws are the neutral base model's)."""
    from peft import LoraConfig, get_peft_model

    ckpt = tmp_path / "suppress"
    shutil.copytree(neutral_dir, ckpt)
    gen_json = ckpt / "generation_config.json"
    gen_json.write_text(json.dumps({**json.loads(gen_json.read_text()), "suppress_tokens": FIELDS["suppress_tokens"]}))
    torch.manual_seed(1)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(ckpt),
                          LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"])).eval()
    neutral = AutoModelForCausalLM.from_pretrained(neutral_dir).eval()
    want, got = _draw(neutral, tok, "plain_generate"), _draw(lora, tok, "plain_generate")
    assert torch.equal(got.responses, want.responses)
    torch.testing.assert_close(got.log_probs, want.log_probs)
    assert lora.get_base_model().generation_config.suppress_tokens == FIELDS["suppress_tokens"]  # restored


def test_the_checkpoint_fields_not_applied_are_named_once(tok, neutral_dir, tmp_path, caplog):
    ckpt = tmp_path / "two"
    shutil.copytree(neutral_dir, ckpt)
    gen_json = ckpt / "generation_config.json"
    gen_json.write_text(json.dumps({**json.loads(gen_json.read_text()), "min_p": 0.5, "stop_strings": ["5"]}))
    loaded = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    with caplog.at_level("INFO", logger="verl_ds.sampling_config"):
        _draw(loaded, tok, "plain_generate"), _draw(loaded, tok, "plain_generate")
    said = [r.getMessage() for r in caplog.records if r.name == "verl_ds.sampling_config"]
    assert len(said) == 1 and "sets min_p, stop_strings; not applied" in said[0], said
