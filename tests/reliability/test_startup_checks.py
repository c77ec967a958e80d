"""Start-up checks peers leave to the user: pad == eos, dropout off in actor/critic/reference, tokenizer vocabulary vs
embedding size, a tokenizer that is missing or unusable; and reward functions that fail inside a real step."""
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from e2e_utils import ROOT, base_env
from verl_ds.config import ConfigError, load_config
from verl_ds.engines.build import build_actor_model, build_critic_model, load_tokenizer
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
BAD_REWARDS = '''
def raises(prompts, responses, batch):
    for p in prompts:
        if p.startswith("odd"):
            raise ValueError("cannot score " + repr(p))
    return [0.0] * len(prompts)

def wrong_shape(prompts, responses, batch):
    return [0.0] * (len(prompts) - 1)

def nan_reward(prompts, responses, batch):
    return [float("nan") if i == 2 else 0.0 for i in range(len(prompts))]
'''


def _save_model(path, arch="llama", vocab=None, pad_is_eos=True, dropout=0.3, vocab_size=None, tokenizer=True):
    """A tiny HF checkpoint directory with dropout > 0 (and its tokenizer, pad == eos by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    tok = build_tokenizer(vocab, pad_is_eos=pad_is_eos)
    n = vocab_size or len(tok)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=n, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=128, attention_dropout=dropout,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
                          tie_word_embeddings=False)
        model = LlamaForCausalLM(cfg)
    else:
        cfg = GPT2Config(vocab_size=n, n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=dropout,
                         embd_pdrop=dropout, attn_pdrop=dropout, eos_token_id=tok.eos_token_id)
        model = GPT2LMHeadModel(cfg)
    model.save_pretrained(path)
    if tokenizer:
        tok.save_pretrained(path)
    return str(path)


def _dropout_rates(model):
    return {f"{type(m).__name__}.{k}": v for m in model.modules()
            for k, v in list(vars(m).items()) + ([("p", m.p)] if isinstance(m, torch.nn.Dropout) else [])
            if ("dropout" in k or k == "p") and isinstance(v, float) and v}


def _repeatable_in_train_mode(model, n_vocab):
    ids = torch.randint(4, n_vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    model.train()
    with torch.no_grad():
        a, b = model(input_ids=ids), model(input_ids=ids)
    a = a.logits if hasattr(a, "logits") else a
    b = b.logits if hasattr(b, "logits") else b
    return torch.equal(a, b)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_dropout_is_off_in_actor_reference_and_critic_even_in_train_mode(tmp_path, arch):
    path = _save_model(tmp_path / arch, arch=arch)
    cfg = load_config(None, [f"model.path={path}"])
    tok = load_tokenizer(cfg)
    from transformers import AutoModelForCausalLM

    raw = AutoModelForCausalLM.from_pretrained(path)
    assert _dropout_rates(raw) and not _repeatable_in_train_mode(raw, len(tok))  # the checkpoint has dropout
    actor = build_actor_model(cfg, tok)  # the reference is built by the same function
    assert _dropout_rates(actor) == {} and _repeatable_in_train_mode(actor, len(tok))
    if arch == "llama":  # CriticLM on the llama backbone
        critic = build_critic_model(cfg, tok)
        assert _dropout_rates(critic) == {} and _repeatable_in_train_mode(critic, len(tok))
        assert critic.config.attention_dropout == 0.0 and actor.config.attention_dropout == 0.0


def test_tokenizer_larger_than_the_embedding_is_refused(tmp_path):
    small = _save_model(tmp_path / "small", vocab_size=10)  # the tokenizer has 300+ tokens
    with pytest.raises(ConfigError, match=r"actor: the tokenizer has \d+ tokens but the model's embedding has 10 rows"):
        build_actor_model(load_config(None, [f"model.path={small}"]), load_tokenizer(load_config(None, [f"model.path={small}"])))
    good = _save_model(tmp_path / "good")
    cfg = load_config(None, [f"model.path={good}", f"model.critic_path={small}"])
    with pytest.raises(ConfigError, match=r"critic: the tokenizer has \d+ tokens but the model's embedding has 10 rows"):
        build_critic_model(cfg, load_tokenizer(cfg))


def test_tokenizer_without_pad_uses_eos_and_says_so(tmp_path, caplog):
    tok = build_tokenizer(None)
    tok.pad_token = None
    tok.save_pretrained(tmp_path / "tok")
    cfg = load_config(None, [f"model.tokenizer_path={tmp_path / 'tok'}"])
    with caplog.at_level(logging.WARNING, logger="verl_ds.engines.build"):
        loaded = load_tokenizer(cfg)
    assert loaded.pad_token_id == loaded.eos_token_id and loaded.padding_side == "left"
    assert "tokenizer has no pad token: using the EOS token" in caplog.text


def test_unusable_tokenizers_are_reported_at_start_up(tmp_path):
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "tokenizer.json").write_text("{broken")
    with pytest.raises(ConfigError, match=r"no usable tokenizer in '.*garbage'"):
        load_tokenizer(load_config(None, [f"model.tokenizer_path={tmp_path / 'garbage'}"]))
    with pytest.raises(ConfigError, match=r"'/no/such/dir' is not a directory"):
        load_tokenizer(load_config(None, ["model.tokenizer_path=/no/such/dir"]))
    tok = build_tokenizer(None)
    tok.eos_token = None
    tok.save_pretrained(tmp_path / "no_eos")
    with pytest.raises(ConfigError, match=r"has no EOS token; responses could never end"):
        load_tokenizer(load_config(None, [f"model.tokenizer_path={tmp_path / 'no_eos'}"]))


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """One real trainer (ZeRO-3 engines) over a pad == eos checkpoint with dropout 0.3, looked at from inside."""
    d = tmp_path_factory.mktemp("probe")
    model = _save_model(d / "model", vocab=parity.VOCAB)
    rewards = d / "bad_rewards.py"
    rewards.write_text(BAD_REWARDS)
    result = d / "result.json"
    overrides = [f"model.path={model}", f"trainer.output_dir={d / 'run'}", "rollout.batch_size=8",
                 "actor.mini_batch_size=4", "actor.micro_batch_size=2", "rollout.max_new_tokens=12",
                 "data.num_train_prompts=64", "data.num_val_prompts=8", "trainer.loggers=[plot]"]
    proc = subprocess.run([sys.executable, os.path.join(HERE, "probe_trainer.py"), str(result), str(rewards), *overrides],
                          cwd=ROOT, env=base_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.load(open(result))


@pytest.mark.slow
def test_pad_equal_to_eos_keeps_the_eos_inside_the_response_mask(probe):
    assert probe["pad_is_eos"]
    rows = probe["pad_eos_rows"]
    ended = [r for r in rows if r["done"]]
    assert ended and any(r["length"] < r["width"] for r in ended), rows  # some responses stop early on EOS
    for r in rows:
        assert r["mask_through_last"] and not r["mask_after_last"], r
        assert r["last_token_is_eos"] == r["done"], r  # the EOS (== pad) itself is a response token


@pytest.mark.slow
def test_dropout_is_off_in_the_real_engines(probe):
    assert probe["engines_training"] == {"actor": True, "critic": True}  # train mode, and still deterministic
    assert probe["dropout_repeatable"] == {"actor": True, "ref": True, "critic": True, "actor_update": True}
    assert all(rate.endswith("=0.0") for rate in probe["dropout_rates"]), probe["dropout_rates"]
    step = probe["step"]
    assert step["training/global_step"] == 1 and step["actor/pg_loss"] == step["actor/pg_loss"]


@pytest.mark.parametrize("name, message", [
    ("raises", r"reward function 'raises' \(sample \d+\): raised ValueError: cannot score 'odd"),
    ("wrong_shape", r"reward function 'wrong_shape': returned 7 values for 8 samples; expected one per sample"),
    ("nan_reward", r"reward function 'nan_reward' \(sample 2\): returned a non-finite reward \(nan\)"),
])
@pytest.mark.slow
def test_a_failing_reward_function_in_a_real_step_names_the_function_and_sample(probe, name, message):
    import re

    err = probe["reward_errors"][name]
    # the step fails on every rank together (StepFailed), naming the rank and the reward function's error
    assert err is not None and err["type"] == "StepFailed", err
    assert re.search(r"rank 0: RewardFunctionError: " + message, err["message"]), err["message"]
