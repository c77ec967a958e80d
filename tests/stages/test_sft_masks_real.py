"""Assistant-only SFT masks with a real checkpoint's byte-level tokenizer and chat template (SmolLM2-135M-Instruct,
ChatML) against TRL's generation-tagged masks: each assistant turn's content and its ``<|im_end|>`` are trained, the
role header and the newline the template writes after ``<|im_end|>`` (never sampled: generation stops on it) are not.
The word-level test tokenizers cannot show this."""
import pytest

from real_templates import generation_tagged_mask, smollm2_tokenizer
from verl_ds.stages.sft_data import SFTDataset, chat_tokens

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 * 12?"}, {"role": "assistant", "content": "12 * 12 = 144."}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Hi there"},
     {"role": "assistant", "content": "Hello! How can I help?"}, {"role": "user", "content": "Write add()."},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"}, {"role": "user", "content": "Thanks"},
     {"role": "assistant", "content": "You're welcome 😊 — café, naïve, 東京."}],
    [{"role": "user", "content": "Count:"}, {"role": "assistant", "content": "1\n2\n\n3  "},
     {"role": "user", "content": "  and?"}, {"role": "assistant", "content": " 4"}],
]


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_chat_mask_equals_trls_generation_tagged_mask(tok, case):
    messages = CONVERSATIONS[case]
    ids, mask, reason = chat_tokens(tok, messages)
    assert reason is None
    trl_ids, trl_mask = generation_tagged_mask(tok, messages)
    assert ids == trl_ids and mask == trl_mask
    end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok.encode("\n", add_special_tokens=False)
    assert newline == [ids[ids.index(end) + 1]] and tok.eos_token_id == end
    trained_ends = [i for i, t in enumerate(ids) if t == end and mask[i]]
    assert len(trained_ends) == sum(m["role"] == "assistant" for m in messages)
    assert all(mask[i + 1] == 0 for i in trained_ends)  # the template's newline after <|im_end|> is not trained


def test_prompt_completion_rows_train_only_the_completions_turns(tok):
    prompt, completion = CONVERSATIONS[1][:4], CONVERSATIONS[1][4:]
    ids, mask, _ = chat_tokens(tok, prompt + completion, first_trained=len(prompt))
    trl_ids, trl_mask = generation_tagged_mask(tok, prompt + completion)
    first = len(tok.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])
    assert ids == trl_ids and mask == [0] * first + trl_mask[first:]


def test_dataset_items_carry_the_masks(tok):
    ds = SFTDataset.from_records([{"messages": CONVERSATIONS[1]}], tok)
    item = ds[0]
    ids, mask = generation_tagged_mask(tok, CONVERSATIONS[1])
    start = mask.index(1)
    end = len(mask) - mask[::-1].index(1)
    assert item["prompt_ids"] == ids[:start]
    assert item["response_ids"] == ids[start:end] and item["loss_mask"] == mask[start:end]
    assert item["response_ids"][-1] == tok.eos_token_id  # the response ends where sampling would stop
