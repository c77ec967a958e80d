"""A corpus of bad data rows, each with the reason it is counted under; then a real run over a file that mixes them
with good rows: it trains, and reports the counts (log line and <run>/data_report.json)."""
import json
import os
from collections import Counter

import pytest

from e2e_utils import read_metrics, run_train
from verl_ds.config import load_config
from verl_ds.data import REASONS, PromptDataset
from verl_ds.engines.build import load_tokenizer
from verl_ds.tasks import parity
from verl_ds.tokenizer import build_tokenizer

MAX_PROMPT = 32
LONG = "odd : " + "1 " * 40 + "=>"  # 43 tokens

# (raw JSON-lines bytes, reason); "truncated" rows are kept (cut from the left), the others are skipped
BAD_ROWS = [
    (b"\xff\xfe odd : 1 2 =>", "non_utf8"),
    (b'{"prompt": "odd : 1 \xc3\x28 =>", "target": "odd"}', "non_utf8"),
    (b"{not json", "invalid_json"),
    (b'{"prompt": "odd : 1 2 =>", "target": "odd"', "invalid_json"),
    (b'{"prompt": "odd : 1 =>", "target": "odd"} trailing', "invalid_json"),
    (b"[1, 2]", "not_an_object"),
    (b"42", "not_an_object"),
    (b'"just a string"', "not_an_object"),
    (b"null", "not_an_object"),
    (b'{"question": "odd : 1 =>", "target": "odd"}', "missing_prompt"),
    (b'{"Prompt": "odd : 1 =>", "target": "odd"}', "missing_prompt"),
    (b'{"prompt": null, "target": "odd"}', "null_prompt"),
    (b'{"prompt": 5, "target": "odd"}', "non_string_prompt"),
    (b'{"prompt": 1.5, "target": "odd"}', "non_string_prompt"),
    (b'{"prompt": true, "target": "odd"}', "non_string_prompt"),
    (b'{"prompt": ["odd", "1"], "target": "odd"}', "non_string_prompt"),
    (b'{"prompt": {"text": "odd : 1 =>"}, "target": "odd"}', "non_string_prompt"),
    (b'{"prompt": [{"role": "user", "content": "odd : 1 =>"}], "target": "odd"}', "non_string_prompt"),
    (b'{"prompt": "", "target": "odd"}', "empty_prompt"),
    (b'{"prompt": "   \\t  ", "target": "odd"}', "empty_prompt"),
    (b'{"prompt": "odd \\ud800 : 1 =>", "target": "odd"}', "invalid_unicode"),
    (b'{"prompt": "odd : 1 2 =>"}', "missing_passthrough"),
    # issue 31 item 17: each of these used to refuse the whole file (a ValueError out of the JSON parser) or pass
    (b'{"prompt": "odd : 3 =>", "target": "odd", "id": ' + b"7" * 5000 + b"}", "huge_number"),
    (b'{"prompt": "odd : 3 =>", "target": "odd", "n": [1, {"big": -' + b"1" * 4301 + b"}]}", "huge_number"),
    (b'{"prompt": "odd : 3 =>", "prompt": "even : 3 =>", "target": "odd"}', "duplicate_key"),
    (b'{"prompt": "odd : 3 =>", "target": "odd", "meta": {"a": 1, "a": 2}}', "duplicate_key"),
    (b'{"prompt": "odd : 3 =>", "target": "odd", "weight": 1e999}', "non_finite_number"),
    (b'{"prompt": "odd : 3 =>", "target": "odd", "weight": -Infinity}', "non_finite_number"),
    (b'{"prompt": "odd : 3 =>", "target": "odd", "scores": [0.5, NaN]}', "non_finite_number"),
    (json.dumps({"prompt": LONG, "target": "odd"}).encode(), "truncated"),
    (json.dumps({"prompt": "even : " + "2 " * 50 + "=>", "target": "even"}).encode(), "truncated"),
]
# distinct rows: a repeated one would be counted (duplicate_row)
GOOD = list(dict.fromkeys(json.dumps(r).encode() for r in parity.generate_prompts(64, seed=3)))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    # the tokenizer a job with a data file gets (the built-in word-level one, general vocabulary)
    return load_tokenizer(load_config(None, [f"data.train_files={tmp_path_factory.mktemp('d')}/x.jsonl"]))


def _dataset(path, tok, **kw):
    return PromptDataset.from_file(str(path), tok, max_prompt_length=MAX_PROMPT, passthrough_keys=["target"], **kw)


def test_the_corpus_covers_twenty_rows_and_every_reason_it_claims():
    assert len(BAD_ROWS) >= 20
    assert {reason for _, reason in BAD_ROWS} <= set(REASONS)


@pytest.mark.parametrize("raw, reason", BAD_ROWS, ids=[f"{i}-{r}" for i, (_, r) in enumerate(BAD_ROWS)])
def test_each_bad_row_is_counted_under_its_reason(tmp_path, tokenizer, raw, reason):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(GOOD[0] + b"\n" + raw + b"\n")
    ds = _dataset(path, tokenizer)
    assert ds.report() == {reason: 1}
    assert len(ds) == (2 if reason == "truncated" else 1)
    assert f"{reason} 1 (line 2)" in ds.summary()
    if reason == "truncated":
        assert len(ds[1]["input_ids"]) == MAX_PROMPT and ds[1]["prompt"].startswith(("odd", "even"))


def test_identical_rows_are_kept_and_counted_with_the_row_they_repeat(tmp_path, tokenizer):
    same = b'{"prompt": "odd : 5 5 =>", "target": "odd"}'
    reordered = b'{"target": "odd", "prompt": "odd : 5 5 =>"}'  # the same row: key order does not matter
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([GOOD[0], same, GOOD[1], same, same, reordered, same, GOOD[2]]) + b"\n")
    ds = _dataset(path, tokenizer)
    assert ds.report() == {"duplicate_row": 4} and len(ds) == 8
    assert "duplicate_row 4 (line 4=line 2, line 5=line 2, line 6=line 2, +1 more)" in ds.summary()


def test_a_file_of_strict_json_problems_keeps_its_good_rows(tmp_path, tokenizer):
    """One file with every new reason: nothing refuses the file, each bad row is counted where it is."""
    new = [(raw, reason) for raw, reason in BAD_ROWS if reason in ("huge_number", "duplicate_key", "non_finite_number")]
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join(GOOD[:3] + [raw for raw, _ in new]) + b"\n")
    ds = _dataset(path, tokenizer)
    assert len(ds) == 3 and ds.report() == {"huge_number": 2, "duplicate_key": 2, "non_finite_number": 3}
    assert "huge_number 2 (line 4, line 5); duplicate_key 2 (line 6, line 7); non_finite_number 3 (line 8, line 9, " \
           "line 10)" in ds.summary()


def test_overlong_rows_are_skipped_when_configured(tmp_path, tokenizer):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b"\n".join([GOOD[0], BAD_ROWS[-1][0]]))
    assert _dataset(path, tokenizer, overlong="skip").report() == {"overlong": 1}


@pytest.mark.slow
def test_a_run_over_a_file_with_bad_rows_trains_and_reports_the_counts(tmp_path):
    """Also a real run with pad == eos (a saved tokenizer, model.tokenizer_path): masks come from lengths, never
    from token != pad."""
    lines = list(GOOD)
    for i, (raw, _) in enumerate(BAD_ROWS):  # spread the bad rows through the file
        lines.insert(2 + 3 * i, raw)
    data = tmp_path / "prompts.jsonl"
    data.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "run"
    tok_dir = tmp_path / "pad_is_eos_tokenizer"
    build_tokenizer(pad_is_eos=True).save_pretrained(str(tok_dir))
    proc = run_train(str(out), [f"data.train_files={data}", "data.passthrough_keys=[target]",
                                f"data.max_prompt_length={MAX_PROMPT}", f"model.tokenizer_path={tok_dir}",
                                "trainer.export=none"])
    expected = Counter(reason for _, reason in BAD_ROWS)
    report = json.load(open(out / "data_report.json"))["train"]
    assert report["problems"] == dict(expected)
    assert report["rows"] == len(lines) and report["kept"] == len(GOOD) + expected["truncated"]
    assert f"kept {report['kept']} of {len(lines)} rows; non_utf8 2 (line" in proc.stderr
    steps = [m for m in read_metrics(str(out)) if "training/global_step" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:
        assert m["training/nonfinite_steps"] == 0 and m["actor/pg_loss"] == m["actor/pg_loss"]
    assert os.path.isfile(out / "checkpoints" / "global_step_2" / "COMPLETE")
