"""SFT rows: TRL's formats, the loss mask on completion / assistant tokens only (by hand, for the built-in
tokenizer's chat template), bad rows skipped and counted by reason, overlong rows, the file formats, and the
``verl-ds sft`` gate (exit 2 naming the key)."""
import json

import pytest

from verl_ds.stages.sft_data import SFTDataset
from verl_ds.tokenizer import build_tokenizer

TOK = build_tokenizer()


def ids(words: str) -> list:
    return TOK.convert_tokens_to_ids(words.split())


CHAT = [{"role": "user", "content": "even : 3 8"}, {"role": "assistant", "content": "2 4"},
        {"role": "user", "content": "odd : 1"}, {"role": "assistant", "content": "3"}]


def test_messages_train_only_the_assistant_turns_content_and_end():
    """'user : even : 3 8<eos> assistant : 2 4<eos> user : odd : 1<eos> assistant : 3<eos>': the prompt ends with
    the first assistant header; the trained tokens are '2 4 <eos>' and '3 <eos>', nothing of the user turns or
    the headers."""
    item = SFTDataset.from_records([{"messages": CHAT}], TOK)[0]
    assert item["prompt_ids"] == ids("user : even : 3 8 <eos> assistant :")
    assert item["response_ids"] == ids("2 4 <eos> user : odd : 1 <eos> assistant : 3 <eos>")
    assert item["loss_mask"] == [1, 1, 1] + [0] * 8 + [1, 1]


def test_prompt_completion_strings_and_conversational():
    text = SFTDataset.from_records([{"prompt": "even : 3 =>", "completion": " 2 4"}], TOK)[0]
    assert text == {"prompt_ids": ids("even : 3 =>"), "response_ids": ids("2 4 <eos>"), "loss_mask": [1, 1, 1]}
    conv = SFTDataset.from_records([{"prompt": CHAT[:3], "completion": CHAT[3:]}], TOK)[0]
    # only the completion's assistant turn trains: the prompt's assistant turn is context here
    assert conv["prompt_ids"] == ids("user : even : 3 8 <eos> assistant : 2 4 <eos> user : odd : 1 <eos> assistant :")
    assert conv["response_ids"] == ids("3 <eos>") and conv["loss_mask"] == [1, 1]
    chat = SFTDataset.from_records([{"prompt": "even : 3", "completion": "2 4"}], TOK, apply_chat_template=True)[0]
    assert chat["prompt_ids"] == ids("user : even : 3 <eos> assistant :") and chat["response_ids"] == ids("2 4 <eos>")


def test_bad_rows_are_skipped_and_counted_by_reason(tmp_path):
    rows = [json.dumps({"prompt": "even : 1 =>", "completion": " 2"}), "{not json", json.dumps([1, 2]),
            json.dumps({"prompt": "odd : 1"}), json.dumps({"messages": [{"role": "user"}]}),
            json.dumps({"messages": [{"role": "user", "content": "even"}]}),
            json.dumps({"prompt": "even", "completion": ["2"]}), json.dumps({"prompt": " ", "completion": "2"}),
            json.dumps({"prompt": "even", "completion": "  "}), json.dumps({"prompt": "even : 1 =>", "completion": " 2"}),
            json.dumps({"prompt": "even", "completion": "2", "x": float("nan")}).replace("NaN", "NaN")]
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(rows) + "\n")
    ds = SFTDataset.from_file(str(path), TOK)
    assert len(ds) == 2  # the good row and its repeat (kept, counted)
    assert ds.report() == {"invalid_json": 1, "not_an_object": 1, "missing_fields": 1, "bad_messages": 1,
                           "no_assistant_turn": 1, "bad_fields": 1, "empty_prompt": 1, "empty_completion": 1,
                           "duplicate_row": 1, "non_finite_number": 1}
    assert "invalid_json 1 (line 2)" in ds.summary()


def test_a_template_less_tokenizer_counts_chat_rows():
    tok = build_tokenizer()
    tok.chat_template = None
    ds = SFTDataset.from_records([{"messages": CHAT}, {"prompt": "even", "completion": "2"}], tok)
    assert ds.report() == {"no_chat_template": 1} and len(ds) == 1


def test_overlong_rows_are_cut_or_skipped():
    row = {"prompt": "even : 1 2 3 4 5 =>", "completion": " 2 4 6 8"}
    cut = SFTDataset.from_records([row], TOK, max_prompt_length=3, max_completion_length=2)
    assert cut[0]["prompt_ids"] == ids("4 5 =>") and cut[0]["response_ids"] == ids("2 4")  # left / right
    assert cut.report() == {"truncated": 1}
    with pytest.raises(ValueError, match="no usable SFT rows.*overlong 1"):
        SFTDataset.from_records([row], TOK, max_prompt_length=3, overlong="skip")


def test_parquet_and_a_datasets_directory(tmp_path):
    import datasets

    rows = [{"prompt": "even : 1 =>", "completion": " 2 4"}, {"prompt": "odd : 2 =>", "completion": " 3"}]
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "rows.parquet"))
    ds.save_to_disk(str(tmp_path / "saved"))
    for path in (tmp_path / "rows.parquet", tmp_path / "saved"):
        got = SFTDataset.from_file(str(path), TOK)
        assert [x["response_ids"] for x in got] == [ids("2 4 <eos>"), ids("3 <eos>")]


def test_cli_refuses_unusable_data_and_bad_batch_arithmetic(tmp_path, capsys):
    from verl_ds.cli import main

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    assert main(["sft", f"data.train_files={bad}", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "data.train_files" in err and "no usable SFT rows" in err and "missing_fields 1" in err
    assert main(["sft", "actor.mini_batch_size=24", "actor.micro_batch_size=16",
                 f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    assert "actor.micro_batch_size=16 must divide" in capsys.readouterr().err
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps({"prompt": "even", "completion": "2"}) + "\n")
    assert main(["sft", f"data.train_files={few}", f"trainer.output_dir={tmp_path / 'run'}"]) == 2
    assert "actor.mini_batch_size=32 is larger than the 1 usable rows" in capsys.readouterr().err


def test_a_stage_this_build_lacks_is_named():
    from verl_ds.cli import stage_module
    from verl_ds.config import ConfigError

    with pytest.raises(ConfigError, match="no nope job .verl_ds.stages.nope is missing"):
        stage_module("nope")
