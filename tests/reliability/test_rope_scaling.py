"""RoPE scalings whose frequencies follow the longest sequence of a forward (transformers' ``dynamic_rope_update``:
``dynamic`` past max_position_embeddings, ``longrope``, as Phi-3's, past original_max_position_embeddings). A job
whose prompt + response could pass that length is refused at start-up, naming rope_scaling and its type; within it
every sequence of a mixed micro-batch scores as it does alone, on the padded and the packed path."""
import pytest
import torch

from verl_ds.config import ConfigError, load_config
from verl_ds.run.startup import check_startup
from verl_ds.models import PolicyModel
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

# kind: (fixed length, config.json key naming it)
KINDS = {"dynamic": (32, "max_position_embeddings"), "longrope": (16, "original_max_position_embeddings")}


def _save(path, kind):
    """A tiny checkpoint with that RoPE scaling: a Llama with dynamic NTK x8, or a Phi-3 with longrope factors."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Phi3Config

    tok = build_tokenizer(parity.VOCAB)
    common = dict(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    if kind == "dynamic":
        cfg = LlamaConfig(max_position_embeddings=32, rope_scaling={"type": "dynamic", "factor": 8.0}, **common)
    else:  # head_dim 8: 4 rotary frequencies, each with its short and long factor
        cfg = Phi3Config(max_position_embeddings=64, original_max_position_embeddings=16,
                         rope_scaling={"type": "longrope", "short_factor": [1.0, 1.2, 1.5, 2.0],
                                       "long_factor": [2.0, 4.0, 8.0, 16.0]}, **common)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharp attention scores: position (the RoPE frequencies) matters
        for name, w in model.named_parameters():
            if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")):
                w.mul_(4.0)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_job_that_could_pass_the_fixed_length_is_refused_at_start_up(tmp_path, kind):
    fixed, length_key = KINDS[kind]
    model = _save(tmp_path / "model", kind)
    common = [f"model.path={model}", "data.max_prompt_length=8", f"trainer.output_dir={tmp_path / 'run'}"]
    with pytest.raises(ConfigError) as info:
        check_startup(load_config(None, common + [f"rollout.max_new_tokens={fixed - 8 + 1}"]))
    message = str(info.value)
    assert message.startswith(f"rollout.max_new_tokens: {fixed - 8 + 1} exceeds this run's limit {fixed - 8} "
                              f"({length_key} of model.path {model!r}={fixed}"), message
    assert f"rope_scaling type {kind!r}" in message, message
    check_startup(load_config(None, common + [f"rollout.max_new_tokens={fixed - 8}"]))  # within it: accepted
    with pytest.raises(ConfigError, match=f"rope_scaling type {kind!r}"):  # the critic's checkpoint counts too
        check_startup(load_config(None, [f"model.critic_path={model}", "data.max_prompt_length=8",
                                         f"rollout.max_new_tokens={fixed}", f"trainer.output_dir={tmp_path / 'c'}"]))


def _alone(lm, ids):
    """Log-probs of tokens 1.. of one unpadded sequence, run alone."""
    with torch.no_grad():
        logits = lm(input_ids=ids[None], use_cache=False).logits[0, :-1].double()
    return torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1)


def _batch(seqs, P, R):
    """(observation, mask): each (prompt, response) pair left-padded to P, right-padded to R."""
    obs = torch.zeros(len(seqs), P + R, dtype=torch.long)
    mask = torch.zeros(len(seqs), P + R, dtype=torch.bool)
    for b, (p, r) in enumerate(seqs):
        obs[b, P - len(p):P], obs[b, P:P + len(r)] = p, r
        mask[b, P - len(p):P], mask[b, P:P + len(r)] = True, True
    return obs, mask


@pytest.mark.parametrize("kind", list(KINDS))
def test_within_the_fixed_length_each_sequence_scores_as_alone(tmp_path, kind):
    from transformers import AutoModelForCausalLM

    fixed, _ = KINDS[kind]
    lm = AutoModelForCausalLM.from_pretrained(_save(tmp_path / "model", kind), attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(1)
    tokens = lambda n: torch.randint(3, 18, (n,), generator=g)  # noqa: E731
    short = (tokens(6), tokens(5))
    P, R = 8, fixed - 8  # the longest sequence is exactly the fixed length
    longest = (tokens(P), tokens(R))
    obs, mask = _batch([short, longest], P, R)
    rmask = mask[:, -R:]
    want = torch.zeros(2, R, dtype=torch.float64)
    for b, (p, r) in enumerate([short, longest]):
        want[b, :len(r)] = _alone(lm, torch.cat([p, r]))[len(p) - 1:]
    for packed in (False, True):
        with torch.no_grad():
            got = PolicyModel(lm, remove_padding=packed).get_logprob(obs, obs[:, -R:], mask)
        torch.testing.assert_close(got.double() * rmask, want * rmask, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"packed={packed}: {m}")
    # past the fixed length the short sequence's log-probs change with its neighbour: why longer jobs are refused
    obs, mask = _batch([short, (tokens(P), tokens(R + 4))], P, R + 4)
    with torch.no_grad():
        moved = PolicyModel(lm).get_logprob(obs, obs[:, -R - 4:], mask)[0, :2].double()
    assert (moved - want[0, :2]).abs().max() > 1e-4, moved - want[0, :2]  # 10x the tolerance above
