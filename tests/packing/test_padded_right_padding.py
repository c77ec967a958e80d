"""The padded scoring path (``model.remove_padding=false``, and the fallback of models that cannot attend per
sequence in a packed row, e.g. Gemma2) with right-padded prompts: each response token, the first included, is
scored as in its sequence run alone without padding (a plain per-sequence forward), log-probs, entropies and
critic values; and a sliding-window model keeps its window over real tokens."""
import pytest
import torch

from packing_testutil import VOCAB, padded_batch, per_sequence_reference, tiny_critic, tiny_lm
from verl_ds.models import PolicyModel, ValueModel

T_SAMPLE = 0.7
PROMPTS, RESPONSES, P, R = [8, 1, 5, 3], [10, 1, 6, 2], 8, 10


def _close(name, got, want, rmask):
    torch.testing.assert_close(got.double() * rmask, want.detach().double() * rmask, atol=1e-5, rtol=1e-5,
                               msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("fused", [False, True])
def test_right_padded_prompts_score_as_each_sequence_alone(fused):
    lm, critic = tiny_lm("llama", seed=11), tiny_critic("llama", seed=12)
    obs, mask = padded_batch(PROMPTS, RESPONSES, P, R, "right", seed=13)
    assert not bool(mask[:, P - 1].all())  # some prompt ends with padding: the case under test
    rmask = mask[:, -R:]
    with torch.no_grad():
        want_lp, want_ent, want_v = per_sequence_reference(lm, critic, obs, mask, R, T_SAMPLE)
        lp, ent = PolicyModel(lm, fused_lm_head=fused).get_logprob(obs, obs[:, -R:], mask, T_SAMPLE,
                                                                   return_entropy=True)
        v = ValueModel(critic).get_values(obs, mask, R)
    _close("log-probs", lp, want_lp, rmask)
    _close("entropy", ent, want_ent, rmask)
    _close("values", v, want_v, rmask)


@pytest.mark.parametrize("side", ["left", "right"])
def test_gemma2_sliding_window_padded_path_equals_each_sequence_alone(side):
    """Gemma2 (logit soft-capping, a sliding window of 3 on every other layer) scores through the padded path; the
    window must cover the last real tokens, not pad columns between the prompt and the response."""
    from transformers import AutoModelForCausalLM, Gemma2Config

    cfg = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=3,
                       max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(14)
    lm = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    obs, mask = padded_batch(PROMPTS, RESPONSES, P, R, side, seed=15)
    rmask = mask[:, -R:]
    with torch.no_grad():
        want_lp, want_ent, _ = per_sequence_reference(lm, None, obs, mask, R, 1.0)
        lp, ent = PolicyModel(lm).get_logprob(obs, obs[:, -R:], mask, return_entropy=True)
    _close(f"{side} log-probs", lp, want_lp, rmask)
    _close(f"{side} entropy", ent, want_ent, rmask)
