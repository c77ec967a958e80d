"""A checkpoint's other stop ids: Llama 3.1's generation_config.json stops on <|end_of_text|>, <|eom_id|> and
<|eot_id|>, while its tokenizer's eos is one of them. ``load_tokenizer`` reads them (``tokenizer.generation_stop_ids``),
``ChatTokens`` counts them as turn ends, and the HF engine ends an agent's turn on them, not only on eos. The
expected turns come from the same draws without stop ids, cut by hand at the first stop id."""
import json
import logging

import pytest
import torch

from verl_ds.agent.chat_tokens import ChatTokens
from verl_ds.agent.episodes import engine_turns
from verl_ds.config import load_config
from verl_ds.engines.build import load_tokenizer
from verl_ds.generation import HFRolloutEngine

from models_testutil import EOS, PAD, tiny_llama_config
from real_templates import real_tokenizer

LLAMA_STOPS = ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]  # Llama-3.1-8B-Instruct generation_config.json


def checkpoint_dir(tmp_path, eos_token_id):
    tok = real_tokenizer("llama3_1")  # eos <|eot_id|>, as the instruct checkpoint's tokenizer_config.json
    tok.save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"bos_token_id": tok.bos_token_id,
                                                                  "eos_token_id": eos_token_id}))
    return tok


def test_load_tokenizer_takes_the_other_stop_ids_from_the_generation_config(tmp_path):
    end_of_text, eom, eot = real_tokenizer("llama3_1").convert_tokens_to_ids(LLAMA_STOPS)
    checkpoint_dir(tmp_path, [end_of_text, eom, eot])
    tok = load_tokenizer(load_config(None, [f"model.path={tmp_path}"]))
    assert tok.eos_token_id == eot and tok.generation_stop_ids == [end_of_text, eom]
    chat = ChatTokens(tok)
    assert chat.stop_ids == [eot, end_of_text, eom] and chat.end_id == eot
    assert chat.ended([11, 12, eom]) and chat.ended([11, end_of_text])


def test_ids_beyond_the_tokenizer_or_an_unreadable_file_are_left_out_with_a_warning(tmp_path, caplog):
    tok = checkpoint_dir(tmp_path, [5, len(real_tokenizer("llama3_1")) + 7])
    with caplog.at_level(logging.WARNING, logger="verl_ds.agent.chat_tokens"):
        loaded = load_tokenizer(load_config(None, [f"model.path={tmp_path}"]))
    assert loaded.generation_stop_ids == [5]
    assert f"generation_config.json: eos_token_id entries [{len(tok) + 7}] are not token ids of the tokenizer " \
           f"(0 to {len(tok) - 1}); left out" in caplog.text
    (tmp_path / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="verl_ds.agent.chat_tokens"):
        assert load_tokenizer(load_config(None, [f"model.path={tmp_path}"])).generation_stop_ids == []
    assert "generation_config.json: not a readable generation config" in caplog.text


def test_without_a_generation_config_only_eos_stops(tmp_path):
    real_tokenizer("llama3_1").save_pretrained(tmp_path)
    tok = load_tokenizer(load_config(None, [f"model.path={tmp_path}"]))
    assert tok.generation_stop_ids == [] and ChatTokens(tok).stop_ids == [tok.eos_token_id]


def _engine(share_prefill: bool, share_decode: bool) -> HFRolloutEngine:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    return HFRolloutEngine(model, pad_token_id=PAD, eos_token_id=EOS, gather_params=False,
                           share_prefill=share_prefill, share_decode=share_decode)


PROMPTS = torch.tensor([[5, 6, 7], [5, 6, 7], [PAD, 8, 9], [PAD, 8, 9]])  # repeated: the shared paths run


def _free_run(engine, width=10):
    torch.manual_seed(1)
    return engine.generate(PROMPTS, (PROMPTS != PAD).long(), max_new_tokens=width, temperature=1.0)


def _stop_of(free) -> int:
    """A token of row 0 that it draws after its first token, not before, and that is not EOS."""
    row = free.responses[0, :int(free.response_length[0])].tolist()
    return next(t for k, t in enumerate(row) if k >= 1 and t != EOS and t not in row[:k])


def _cut(free, stops):
    """(length, done) per row: the free run cut after its first token in ``stops``."""
    out = []
    for r in range(free.responses.shape[0]):
        row = free.responses[r, :int(free.response_length[r])].tolist()
        k = next((i for i, t in enumerate(row) if t in stops), None)
        out.append((len(row), bool(free.done[r])) if k is None else (k + 1, True))
    return out


@pytest.mark.parametrize("share_prefill,share_decode", [(False, False), (True, False), (True, True)])
def test_the_hf_engine_ends_a_response_on_a_stop_id(share_prefill, share_decode):
    engine = _engine(share_prefill, share_decode)
    free = _free_run(engine)
    stop = _stop_of(free)
    torch.manual_seed(1)
    got = engine.generate(PROMPTS, (PROMPTS != PAD).long(), max_new_tokens=10, temperature=1.0,
                          stop_token_ids=[stop])
    want = _cut(free, {EOS, stop})
    assert [(int(n), bool(d)) for n, d in zip(got.response_length, got.done)] == want
    assert int(got.response_length[0]) < int(free.response_length[0])  # row 0 really stopped early
    for r, (n, _) in enumerate(want):
        assert got.responses[r, :n].tolist() == free.responses[r, :n].tolist()
        assert (got.responses[r, n:] == PAD).all() and (got.log_probs[r, n:] == 0).all()
        torch.testing.assert_close(got.log_probs[r, :n], free.log_probs[r, :n], rtol=0, atol=1e-5)


def test_agent_turns_end_on_the_chats_stop_ids():
    engine = _engine(True, True)
    free = _free_run(engine)
    stop = _stop_of(free)
    turns = engine_turns(engine, PAD, stop_token_ids=[EOS, stop], temperature=1.0)
    torch.manual_seed(1)
    got = turns([[5, 6, 7], [5, 6, 7], [8, 9], [8, 9]], 10)
    for (ids, lps), (n, _), r in zip(got, _cut(free, {EOS, stop}), range(4)):
        assert ids == free.responses[r, :n].tolist() and len(lps) == n


def test_a_demonstration_closes_its_turns_as_the_template_does():
    # the cold start's conversations are laid out as rollouts lay them out: each assistant turn ends on the template's
    # end-of-turn token (<|eot_id|>), not on eos when eos is another stop id (<|end_of_text|>, Llama 3 base configs)
    from verl_ds.agent.warmup import demonstration_tokens

    tok = real_tokenizer("llama3_1", eos="<|end_of_text|>")
    end_of_text, eom, eot = tok.convert_tokens_to_ids(LLAMA_STOPS)
    tok.generation_stop_ids = [eot, eom]
    chat = ChatTokens(tok)
    call = json.dumps({"name": "calc", "parameters": {"expression": "4821 * 37"}})
    messages = [{"role": "user", "content": "What is 4821 * 37?"}, {"role": "assistant", "content": call},
                {"role": "tool", "content": "178377"}, {"role": "assistant", "content": "178377"}]
    ids, mask = demonstration_tokens(chat, messages)
    want = chat.incremental(messages[:3]) + tok.encode("178377", add_special_tokens=False) + [eot]
    assert ids == want and end_of_text not in ids
    assert [i for i, m in zip(ids, mask) if m] == (tok.encode(call, add_special_tokens=False) + [eot]
                                                   + tok.encode("178377", add_special_tokens=False) + [eot])
