"""The built-in tokenizer: special tokens, digits, chat template, left padding, save/load round trip."""
import pytest
from transformers import AutoTokenizer

from verl_ds.tasks import gsm8k, parity
from verl_ds.tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer, default_vocab


def test_special_tokens_and_pad_is_eos():
    tok = build_tokenizer()
    assert [tok.pad_token, tok.eos_token, tok.bos_token, tok.unk_token] == list(SPECIAL_TOKENS)
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    same = build_tokenizer(pad_is_eos=True)
    assert same.pad_token_id == same.eos_token_id == 1
    assert same.get_vocab() == tok.get_vocab()  # only the pad role changes, so models stay compatible
    assert tok.padding_side == "left"


def test_digits_are_single_tokens_and_numbers_decode_back():
    tok = build_tokenizer()
    ids = tok("even : 3 8 =>", add_special_tokens=False)["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["even", ":", "3", "8", "=>"]
    ids = tok("Tom has 348 apples. #### 42")["input_ids"]
    assert tok.convert_ids_to_tokens(ids) == ["Tom", "has", "3", "@@4", "@@8", "apples", ".", "####", "4", "@@2"]
    assert tok.decode(ids) == "Tom has 348 apples . #### 42"
    assert tok.decode(tok("unknownword 5")["input_ids"]) == "<unk> 5"
    assert tok.decode([tok.eos_token_id, 7, tok.pad_token_id], skip_special_tokens=True) == tok.decode([7])


def test_vocab_covers_the_shipped_tasks():
    tok = build_tokenizer()
    texts = [r["prompt"] for r in parity.generate_prompts(50, 0)] + [
        gsm8k.with_instruction(r["question"]) for r in gsm8k.load_mini()]
    for text in texts:
        assert tok.unk_token_id not in tok(text)["input_ids"], text
    small = build_tokenizer(parity.VOCAB)
    assert len(small) == 18
    for record in parity.generate_prompts(50, 1):
        assert small.unk_token_id not in small(record["prompt"])["input_ids"]
    assert len(set(default_vocab())) == len(default_vocab())


def test_chat_template_and_left_padding():
    tok = build_tokenizer()
    text = tok.apply_chat_template([{"role": "user", "content": "odd : 1 2 =>"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "user : odd : 1 2 => assistant :"
    two = tok.apply_chat_template([{"role": "system", "content": "odd"}, {"role": "user", "content": "1"}],
                                  tokenize=False)
    assert two == "system : odd<eos> user : 1"
    turn = tok.apply_chat_template([{"role": "user", "content": "1"}, {"role": "assistant", "content": "odd"}],
                                   tokenize=False)
    assert turn == "user : 1<eos> assistant : odd<eos>"  # a sampled turn ends on EOS: the template closes it so
    batch = tok(["even : 3", "odd : 1 2 3 4"], padding=True)
    assert batch["input_ids"][0][:3] == [tok.pad_token_id] * 3
    assert batch["attention_mask"][0] == [0, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("pad_is_eos", [False, True])
def test_save_pretrained_round_trip(tmp_path, pad_is_eos):
    tok = build_tokenizer(pad_is_eos=pad_is_eos)
    tok.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "Each bag has 15 oranges. #### 105"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.decode(tok(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])
    assert loaded.get_vocab() == tok.get_vocab()
    assert (loaded.pad_token_id, loaded.eos_token_id, loaded.bos_token_id, loaded.unk_token_id) == \
        (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id)
    assert loaded.padding_side == "left" and loaded.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("vocab", ["even odd", ["even", "two words"], ["ok", ""], [3]])
def test_bad_vocab(vocab):
    with pytest.raises(ValueError, match="vocab: expected a list of non-empty tokens without whitespace"):
        build_tokenizer(vocab)
