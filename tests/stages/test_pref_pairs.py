"""verl_ds.stages.pairs: TRL's preference formats (standard / conversational, explicit / implicit prompt) tokenized
with the loss on completion tokens only, the rollout layout of a batch of pairs, bad rows skipped and counted by
reason from JSON lines, Parquet and a datasets directory; and the parity task's preference pairs ranked by its rule."""
import json

import pytest
import torch

from verl_ds.stages.pairs import REASONS, PreferenceDataset, collate_pairs
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

from chat_testutil import chat_tokenizer

TOK = build_tokenizer()
EOS = TOK.eos_token_id


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


def test_standard_explicit_prompt_gets_eos_and_completion_positions():
    ds = PreferenceDataset.from_records([{"prompt": "even : 3 8 =>", "chosen": "2 4", "rejected": "1 3 5"}], TOK)
    it = ds[0]
    assert it["prompt_ids"] == ids("even : 3 8 =>")
    assert it["chosen_ids"] == ids("2 4") + [EOS] and it["rejected_ids"] == ids("1 3 5") + [EOS]
    assert it["prompt"] == "even : 3 8 =>"
    # a completion that already ends with EOS gets no second one
    ds = PreferenceDataset.from_records([{"prompt": "odd =>", "chosen": "1 <eos>", "rejected": "2"}], TOK)
    assert ds[0]["chosen_ids"] == ids("1") + [EOS]


def test_collate_is_the_rollout_layout():
    items = [{"prompt_ids": [5, 6], "chosen_ids": [7, 1], "rejected_ids": [8, 9, 1], "prompt": "a"},
             {"prompt_ids": [4], "chosen_ids": [1], "rejected_ids": [2, 1], "prompt": "b"}]
    b = collate_pairs(items, pad_token_id=0)
    # rows: chosen 0, chosen 1, rejected 0, rejected 1; prompts left-padded to P=2, completions right-padded to R=3
    want = torch.tensor([[5, 6, 7, 1, 0], [0, 4, 1, 0, 0], [5, 6, 8, 9, 1], [0, 4, 2, 1, 0]])
    assert torch.equal(b["input_ids"], want)
    assert torch.equal(b["attention_mask"], want != 0)
    assert torch.equal(b["response_mask"], torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]]).bool())
    assert b["pairs"] == 2
    with pytest.raises(ValueError, match="items is empty"):
        collate_pairs([], 0)


def test_implicit_prompt_text_is_the_common_token_prefix():
    ds = PreferenceDataset.from_records([{"chosen": "even : 3 => 2 4", "rejected": "even : 3 => 1 4"},
                                         {"chosen": "odd => 1", "rejected": "odd => 1 3"}], TOK)
    assert ds[0]["prompt_ids"] == ids("even : 3 =>")
    assert ds[0]["chosen_ids"] == ids("2 4") + [EOS] and ds[0]["rejected_ids"] == ids("1 4") + [EOS]
    # one is a prefix of the other: the prompt stops a token earlier so both keep a token of their own
    assert ds[1]["prompt_ids"] == ids("odd =>")
    assert ds[1]["chosen_ids"] == ids("1") + [EOS] and ds[1]["rejected_ids"] == ids("1 3") + [EOS]


def test_conversational_builtin_template_prompt_and_sampled_completion():
    # the built-in template does not render a prompt as a prefix of the whole conversation (the user turn gets EOS
    # only when another message follows): the completion is what the model samples after the generation prompt
    prompt = [{"role": "user", "content": "even : 3 =>"}]
    row = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "2 4"}],
           "rejected": [{"role": "assistant", "content": "1 3"}]}
    ds = PreferenceDataset.from_records([row], TOK)
    head = TOK.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    assert head == "user : even : 3 => assistant :"
    assert ds[0]["prompt_ids"] == ids(head)
    assert ds[0]["chosen_ids"] == ids("2 4") + [EOS] and ds[0]["rejected_ids"] == ids("1 3") + [EOS]
    assert ds[0]["prompt"] == "even : 3 =>"
    # implicit prompt: the shared first messages
    ds2 = PreferenceDataset.from_records([{"chosen": prompt + row["chosen"], "rejected": prompt + row["rejected"]}],
                                         TOK)
    assert ds2[0] == ds[0]


def test_conversational_chatml_matches_trl_rendering_delta():
    # a template that renders the prompt as a prefix (ChatML): TRL's completion is the whole rendering after the
    # prompt's; ours is the same up to and including the end-of-turn token (the model stops there; the newline
    # after it is never sampled)
    tok = chat_tokenizer("chatml")
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the sky?"}]
    chosen = [{"role": "assistant", "content": "It is blue."}]
    rejected = [{"role": "assistant", "content": "Green, then."}]
    ds = PreferenceDataset.from_records([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], tok)
    head = tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    for key, completion in (("chosen_ids", chosen), ("rejected_ids", rejected)):
        full = tok.apply_chat_template(prompt + completion, tokenize=False)
        assert full.startswith(head) and full.endswith("<|im_end|>\n")
        assert ds[0][key] == tok(full[len(head):-1], add_special_tokens=False)["input_ids"]
    assert ds[0]["prompt_ids"] == tok(head, add_special_tokens=False)["input_ids"]


def test_conversational_completion_with_a_tool_turn_equals_the_whole_rendering():
    tok = chat_tokenizer("chatml")
    prompt = [{"role": "user", "content": "12 * 3?"}]
    chosen = [{"role": "assistant", "content": "calling"}, {"role": "tool", "content": "36"},
              {"role": "assistant", "content": "36"}]
    rejected = [{"role": "assistant", "content": "35"}]
    ds = PreferenceDataset.from_records([{"prompt": prompt, "chosen": chosen, "rejected": rejected}], tok)
    whole = tok.apply_chat_template(prompt + chosen, tokenize=False)[:-1]  # up to the last <|im_end|>
    assert ds[0]["prompt_ids"] + ds[0]["chosen_ids"] == tok(whole, add_special_tokens=False)["input_ids"]


def _bad_rows():
    ok = {"prompt": "even : 1 =>", "chosen": "2 4", "rejected": "1 3"}
    msgs = [{"role": "user", "content": "x"}]
    return [
        ("ok", ok),
        ("not_an_object", [1, 2]),
        ("missing_field", {"prompt": "p", "chosen": "2"}),
        ("non_string_field", {"prompt": "p", "chosen": 3, "rejected": "1"}),
        ("non_string_field", {"prompt": None, "chosen": "2", "rejected": "1"}),
        ("mixed_formats", {"prompt": msgs, "chosen": "2", "rejected": "1"}),
        ("empty_prompt", {"prompt": "   ", "chosen": "2", "rejected": "1"}),
        ("empty_prompt", {"chosen": "2 4", "rejected": "1 3"}),  # implicit, nothing shared
        ("empty_completion", {"prompt": "p =>", "chosen": "", "rejected": "1"}),
        ("identical", {"prompt": "p =>", "chosen": "2", "rejected": "2"}),
        ("identical", {"prompt": "p =>", "chosen": "2", "rejected": "2 <eos>"}),  # the same tokens
        ("completion_not_assistant", {"prompt": msgs, "chosen": [{"role": "user", "content": "2"}],
                                      "rejected": [{"role": "assistant", "content": "1"}]}),
        ("empty_completion", {"prompt": msgs, "chosen": [{"role": "assistant", "content": " "}],
                              "rejected": [{"role": "assistant", "content": "1"}]}),
        ("overlong", {"prompt": "even : 1 =>", "chosen": "2 4 6 8 0 2 4 6", "rejected": "1"}),
        ("overlong", {"prompt": "even : 1 3 5 7 9 =>", "chosen": "2", "rejected": "1"}),
    ]


def test_bad_rows_skipped_and_counted_by_reason():
    rows = _bad_rows()
    ds = PreferenceDataset.from_records([r for _, r in rows], TOK, max_prompt_length=6, max_completion_length=4,
                                        overlong="skip")
    assert len(ds) == 1 and ds[0]["chosen_ids"] == ids("2 4") + [EOS]
    want = {}
    for reason, _ in rows[1:]:
        want[reason] = want.get(reason, 0) + 1
    assert ds.report() == want
    assert set(want) <= set(REASONS)
    assert "kept 1 of 15 preference rows" in ds.summary() and "overlong 2 (record 13, record 14)" in ds.summary()


def test_long_prompts_are_cut_from_the_left_by_default():
    row = {"prompt": "even : 1 3 5 7 9 =>", "chosen": "2", "rejected": "1"}
    ds = PreferenceDataset.from_records([row], TOK, max_prompt_length=3)
    assert ds[0]["prompt_ids"] == ids("7 9 =>") and ds.report() == {"truncated": 1}
    with pytest.raises(ValueError, match="max_prompt_length: expected a positive int"):
        PreferenceDataset.from_records([row], TOK, max_prompt_length=0)


def test_messages_without_a_chat_template_are_counted():
    tok = build_tokenizer()
    tok.chat_template = None
    rows = [{"prompt": "p =>", "chosen": "1", "rejected": "2"},
            {"prompt": [{"role": "user", "content": "x"}], "chosen": [{"role": "assistant", "content": "1"}],
             "rejected": [{"role": "assistant", "content": "2"}]}]
    assert PreferenceDataset.from_records(rows, tok).report() == {"no_chat_template": 1}


def test_jsonl_file_reasons_duplicates_and_no_usable_rows(tmp_path):
    path = tmp_path / "prefs.jsonl"
    good = json.dumps({"prompt": "odd =>", "chosen": "1 3", "rejected": "2 4"})
    path.write_bytes(b"\n".join([good.encode(), b"{not json", b"\xff\xfe", good.encode(),
                                 b'{"prompt": "p", "prompt": "q", "chosen": "1", "rejected": "2"}',
                                 b'{"prompt": "p =>", "chosen": "1", "rejected": NaN}', b""]))
    ds = PreferenceDataset.from_file(path, TOK)
    assert len(ds) == 2
    assert ds.report() == {"invalid_json": 1, "non_utf8": 1, "duplicate_key": 1, "non_finite_number": 1,
                           "duplicate_row": 1}
    assert "duplicate_row 1 (line 4=line 1)" in ds.summary()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"no usable preference pairs .*fields of the first row: \['answer', "
                                         r"'question'\].*missing_field 1"):
        PreferenceDataset.from_file(bad, TOK)
    with pytest.raises(ValueError, match="does not exist"):
        PreferenceDataset.from_file(tmp_path / "nope.jsonl", TOK)
    with pytest.raises(ValueError, match="unsupported extension '.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        PreferenceDataset.from_file(tmp_path / "x.csv", TOK)


def test_parquet_and_datasets_directory(tmp_path):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = parity.preference_pairs(6, seed=5)
    conv = [{"prompt": [{"role": "user", "content": r["prompt"]}],
             "chosen": [{"role": "assistant", "content": r["chosen"]}],
             "rejected": [{"role": "assistant", "content": r["rejected"]}]} for r in records]
    want = PreferenceDataset.from_records(records, TOK).items
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "p.parquet")
    assert PreferenceDataset.from_file(str(tmp_path / "p.parquet"), TOK).items == want
    datasets.DatasetDict({"train": datasets.Dataset.from_list(conv)}).save_to_disk(str(tmp_path / "d"))
    got = PreferenceDataset.from_file(str(tmp_path / "d"), TOK, split="train")
    assert len(got) == 6 and got.report() == {}
    assert got[0]["chosen_ids"] == ids(records[0]["chosen"]) + [EOS]


def test_parity_preference_pairs_are_ranked_by_the_rule():
    rows = parity.preference_pairs(200, seed=3)
    assert rows == parity.preference_pairs(200, seed=3)
    assert rows != parity.preference_pairs(200, seed=4)
    assert [r["prompt"] for r in rows] == [p["prompt"] for p in parity.generate_prompts(200, 3)]
    gaps = []
    for r in rows:
        target = parity.target_of(r["prompt"])
        gaps.append(parity.score(r["chosen"], target) - parity.score(r["rejected"], target))
    assert min(gaps) > 0
    assert sum(gaps) / len(gaps) > 0.4  # best vs worst of four: a clear signal for a reward model
    with pytest.raises(ValueError, match="candidates"):
        parity.preference_pairs(2, 0, candidates=1)
