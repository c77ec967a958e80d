"""PromptDataset: file formats, options, chat template, and the bad-row corpus (each row with its counted reason)."""
import json

import pytest

from verl_ds.data import REASONS, PromptDataset
from verl_ds.tasks import gsm8k, parity
from verl_ds.tokenizer import build_tokenizer

GOOD = {"prompt": "even : 3 8 =>", "target": "even"}


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def write_lines(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def test_jsonl_items_and_passthrough(tmp_path, tok):
    records = parity.generate_prompts(20, seed=0)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    ds = PromptDataset.from_file(str(path), tok)
    assert len(ds) == 20 and ds.report() == {}
    assert ds.summary() == f"{path}: kept 20 of 20 rows"
    assert ds[3] == {"input_ids": tok(records[3]["prompt"])["input_ids"], "prompt": records[3]["prompt"],
                     "target": records[3]["target"]}


def test_bom_crlf_and_blank_lines_are_not_bad_rows(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    other = {**GOOD, "target": "other"}  # the same row twice would be counted as a duplicate_row
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\r\n\r\n   \n" + json.dumps(other).encode())
    ds = PromptDataset.from_file(str(path), tok)
    assert len(ds) == 2 and ds.report() == {}


def test_json_array_file(tmp_path, tok):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, {"prompt": None}, GOOD]))
    ds = PromptDataset.from_file(str(path), tok)
    assert len(ds) == 2 and ds.report() == {"null_prompt": 1, "duplicate_row": 1}
    assert "null_prompt 1 (item 1)" in ds.summary()
    path.write_text("[" + json.dumps(GOOD) + ",")
    with pytest.raises(ValueError, match="not a valid JSON array"):
        PromptDataset.from_file(str(path), tok)


def test_json_array_file_with_rows_the_parser_would_refuse_or_accept_silently(tmp_path, tok):
    """A 5000-digit integer used to raise out of json.loads and refuse the whole array; repeated keys, 1e999 and
    a repeated row passed unreported. Each is now counted at its item; the array's other rows are kept."""
    items = [json.dumps(GOOD), '{"prompt": "odd : 1 =>", "n": ' + "9" * 5000 + "}",
             '{"prompt": "odd : 2 =>", "prompt": "even : 2 =>"}', '{"prompt": "odd : 3 =>", "w": 1e999}',
             json.dumps({"target": "even", "prompt": "even : 3 8 =>"}), '{"prompt": "odd : 4 =>"}']
    path = tmp_path / "d.json"
    path.write_text("[" + ", ".join(items) + "]")
    ds = PromptDataset.from_file(str(path), tok)
    assert ds.report() == {"huge_number": 1, "duplicate_key": 1, "non_finite_number": 1, "duplicate_row": 1}
    assert [item["prompt"] for item in ds] == ["even : 3 8 =>", "even : 3 8 =>", "odd : 4 =>"]
    assert "duplicate_row 1 (item 4=item 0)" in ds.summary()


def test_generated_records_are_not_checked_for_repeats(tok):
    """from_records serves the built-in task, whose short prompts repeat by design (826 of its default 4096)."""
    assert PromptDataset.from_records([GOOD, GOOD], tok).report() == {}


def test_json_lines_in_a_json_file(tmp_path, tok):
    path = write_lines(tmp_path / "d.json", [json.dumps(GOOD).encode(), b"{oops"])
    assert PromptDataset.from_file(path, tok).report() == {"invalid_json": 1}


def test_parquet(tmp_path, tok):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    table = pa.table({"question": ["Tom has 3 apples.", None, "", "A box holds 12 pencils."],
                      "answer": [8, 1, 2, 48]})
    pq.write_table(table, tmp_path / "d.parquet")
    ds = PromptDataset.from_file(str(tmp_path / "d.parquet"), tok, prompt_key="question",
                                 passthrough_keys=["answer"])
    assert len(ds) == 2 and ds.report() == {"null_prompt": 1, "empty_prompt": 1}
    assert [ds[i]["answer"] for i in range(2)] == [8, 48]
    assert "null_prompt 1 (row 1); empty_prompt 1 (row 2)" in ds.summary()
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(ValueError, match="cannot read as Parquet"):
        PromptDataset.from_file(str(tmp_path / "bad.parquet"), tok)


def test_saved_datasets_directory(tmp_path, tok):
    datasets = pytest.importorskip("datasets")
    rows = gsm8k.load_mini()
    ds_train = datasets.Dataset.from_list(rows)
    ds_train.save_to_disk(str(tmp_path / "single"))
    ds = PromptDataset.from_file(str(tmp_path / "single"), tok, prompt_key="question")
    assert len(ds) == len(rows) and ds[0]["answer"] == rows[0]["answer"] and ds[0]["prompt"] == rows[0]["question"]

    datasets.DatasetDict({"train": ds_train, "test": ds_train.select(range(5))}).save_to_disk(str(tmp_path / "dd"))
    assert len(PromptDataset.from_file(str(tmp_path / "dd"), tok, prompt_key="question")) == len(rows)
    assert len(PromptDataset.from_file(str(tmp_path / "dd"), tok, split="test", prompt_key="question")) == 5
    with pytest.raises(ValueError, match=r"holds splits \['train', 'test'\]; set split to one of them \(got 'val'\)"):
        PromptDataset.from_file(str(tmp_path / "dd"), tok, split="val", prompt_key="question")
    with pytest.raises(ValueError, match="split='test' given but .* holds a single data set"):
        PromptDataset.from_file(str(tmp_path / "single"), tok, split="test", prompt_key="question")
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ValueError, match="is not a data set saved with datasets' save_to_disk"):
        PromptDataset.from_file(str(tmp_path / "empty_dir"), tok)


def test_file_errors(tmp_path, tok):
    with pytest.raises(ValueError, match="data file '.*nope.jsonl' does not exist"):
        PromptDataset.from_file(str(tmp_path / "nope.jsonl"), tok)
    (tmp_path / "d.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match=r"unsupported extension '\.csv'; expected one of"):
        PromptDataset.from_file(str(tmp_path / "d.csv"), tok)
    with pytest.raises(TypeError, match=r"unknown options \['promt_key'\]"):
        PromptDataset.from_file(str(tmp_path / "d.csv"), tok, promt_key="x")
    with pytest.raises(TypeError, match="path: expected a file or directory path, got int"):
        PromptDataset.from_file(3, tok)


def test_zero_usable_rows_is_an_error_with_the_reasons(tmp_path, tok):
    path = write_lines(tmp_path / "d.jsonl", [b'{"text": "a"}', b'{"text": "b"}', b"{"])
    with pytest.raises(ValueError, match=r"no usable prompts \(prompt_key='prompt'; fields of the first row: "
                                         r"\['text'\]\)\..*kept 0 of 3 rows; "
                                         r"missing_prompt 2 \(line 1, line 2\); invalid_json 1 \(line 3\)"):
        PromptDataset.from_file(path, tok)


def test_overlong_truncate_keeps_the_end_and_skip_drops(tok):
    long = "odd : " + " ".join("1234567890" * 3) + " =>"
    full = tok(long)["input_ids"]
    ds = PromptDataset.from_records([GOOD, {"prompt": long}], tok, max_prompt_length=8)
    assert ds[1]["input_ids"] == full[-8:] and ds[1]["prompt"] == long
    assert ds.report() == {"truncated": 1} and len(ds) == 2
    ds = PromptDataset.from_records([GOOD, {"prompt": long}], tok, max_prompt_length=8, overlong="skip")
    assert ds.report() == {"overlong": 1} and len(ds) == 1
    with pytest.raises(ValueError, match=r"record 1: prompt has 33 tokens > max_prompt_length=8 \(overlong='error'"):
        PromptDataset.from_records([GOOD, {"prompt": long}], tok, max_prompt_length=8, overlong="error")
    exact = PromptDataset.from_records([GOOD], tok, max_prompt_length=len(tok(GOOD["prompt"])["input_ids"]))
    assert exact.report() == {}


def test_empty_error_mode(tok):
    with pytest.raises(ValueError, match=r"record 1: empty prompt \(empty='error'"):
        PromptDataset.from_records([GOOD, {"prompt": " "}], tok, empty="error")


def test_chat_template(tok):
    ds = PromptDataset.from_records([GOOD], tok, apply_chat_template=True)
    assert tok.decode(ds[0]["input_ids"]) == "user : even : 3 8 => assistant :"
    assert ds[0]["prompt"] == GOOD["prompt"]  # reward functions see the raw prompt
    messages = [{"role": "system", "content": "odd"}, {"role": "user", "content": "1 2 =>"}]
    ds = PromptDataset.from_records([{"prompt": messages}], tok, apply_chat_template=True)
    assert tok.decode(ds[0]["input_ids"]) == "system : odd <eos> user : 1 2 => assistant :"
    assert ds[0]["prompt"] == "1 2 =>"
    strict = build_tokenizer()
    strict.chat_template = ("{% if messages|length > 1 %}{{ raise_exception('roles must alternate') }}{% endif %}"
                            "{{ messages[0]['content'] }}")
    ds = PromptDataset.from_records([GOOD, {"prompt": messages}], strict, apply_chat_template=True)
    assert len(ds) == 1 and ds.report() == {"chat_template_error": 1}
    bare = build_tokenizer()
    bare.chat_template = None
    with pytest.raises(ValueError, match="apply_chat_template=True but the tokenizer has no chat_template"):
        PromptDataset.from_records([GOOD], bare, apply_chat_template=True)


def test_passthrough_keys(tok):
    records = [{"prompt": "1", "answer": "1", "id": 0}, {"prompt": "2", "id": 1}]
    ds = PromptDataset.from_records(records, tok)
    assert ds[1] == {"input_ids": tok("2")["input_ids"], "prompt": "2", "answer": None, "id": 1}
    ds = PromptDataset.from_records(records, tok, passthrough_keys=["answer"])
    assert len(ds) == 1 and set(ds[0]) == {"input_ids", "prompt", "answer"}
    assert ds.report() == {"missing_passthrough": 1}


def test_reserved_fields_are_not_passed_through(tok):
    records = [{"question": "1", "prompt": "other", "input_ids": [9, 9], "answer": "1"}]
    ds = PromptDataset.from_records(records, tok, prompt_key="question")
    assert ds[0] == {"input_ids": tok("1")["input_ids"], "prompt": "1", "answer": "1"}
    with pytest.raises(ValueError, match=r"passthrough_keys: \['input_ids'\] are reserved for the tokenized prompt"):
        PromptDataset.from_records(records, tok, prompt_key="question", passthrough_keys=["answer", "input_ids"])


@pytest.mark.parametrize("kwargs, message", [
    (dict(prompt_key=""), "prompt_key: expected a non-empty field name, got ''"),
    (dict(max_prompt_length=0), "max_prompt_length: expected a positive int or None, got 0"),
    (dict(max_prompt_length=True), "max_prompt_length: expected a positive int or None, got True"),
    (dict(overlong="cut"), "overlong: expected 'truncate', 'skip' or 'error', got 'cut'"),
    (dict(empty="ignore"), "empty: expected 'skip' or 'error', got 'ignore'"),
    (dict(passthrough_keys="answer"), "passthrough_keys: expected None or a list of field names, got 'answer'"),
])
def test_bad_options(tok, kwargs, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        PromptDataset.from_records([GOOD], tok, **kwargs)


def test_bad_records_and_tokenizer(tok):
    with pytest.raises(TypeError, match="records: expected a list of dicts, got dict"):
        PromptDataset.from_records(GOOD, tok)
    with pytest.raises(TypeError, match="tokenizer: expected a HuggingFace tokenizer, got str"):
        PromptDataset.from_records([GOOD], "gpt2")


# One bad JSON line each, with the reason it must be counted under. Options apply to that case only.
BAD_ROWS = [
    (b"\xff\xfe\x00garbage", "non_utf8", {}),
    (b'{"prompt": "caf\xe9 : 1 =>"}', "non_utf8", {}),  # latin-1, not UTF-8
    (b'{"prompt": "even : 1 =>"', "invalid_json", {}),
    (b"{'prompt': 'single quotes'}", "invalid_json", {}),
    (b'{"prompt": "even", }', "invalid_json", {}),
    (b'{"prompt": "even"} trailing', "invalid_json", {}),
    (b"[1, 2]", "not_an_object", {}),
    (b'"just a string"', "not_an_object", {}),
    (b"42", "not_an_object", {}),
    (b"null", "not_an_object", {}),
    (b'{"text": "even : 1 =>"}', "missing_prompt", {}),
    (b"{}", "missing_prompt", {}),
    (b'{"prompt": null}', "null_prompt", {}),
    (b'{"prompt": 17}', "non_string_prompt", {}),
    (b'{"prompt": 1.5e3}', "non_string_prompt", {}),
    (b'{"prompt": NaN}', "non_finite_number", {}),  # not JSON (RFC 8259): counted as such, before the type
    (b'{"prompt": true}', "non_string_prompt", {}),
    (b'{"prompt": ["even", "1"]}', "non_string_prompt", {}),
    (b'{"prompt": {"text": "even"}}', "non_string_prompt", {}),
    (b'{"prompt": [{"role": "user", "content": "even"}]}', "non_string_prompt", {}),  # messages need the template
    (b'{"prompt": [{"role": "user"}]}', "non_string_prompt", {"apply_chat_template": True}),
    (b'{"prompt": []}', "non_string_prompt", {"apply_chat_template": True}),
    (b'{"prompt": ""}', "empty_prompt", {}),
    (b'{"prompt": "   \\t\\n "}', "empty_prompt", {}),
    (b'{"prompt": "\\u3000\\u2003"}', "empty_prompt", {}),  # unicode spaces
    (b'{"prompt": [{"role": "user", "content": " "}]}', "empty_prompt", {"apply_chat_template": True}),
    (b'{"prompt": "\\ud800 even"}', "invalid_unicode", {}),  # unpaired surrogate escape
    (b'{"prompt": "odd : 1 2 3 4 5 6 7 8 9 =>"}', "overlong", {"max_prompt_length": 10, "overlong": "skip"}),
    (b'{"prompt": "odd : 1 2 3 4 5 6 7 8 9 =>"}', "truncated", {"max_prompt_length": 10}),
    (b'{"prompt": "even : 2 =>"}', "missing_passthrough", {"passthrough_keys": ["target"]}),
    (b"[" * 50000, "too_deep", {}),  # a RecursionError in the JSON parser: counted and skipped, not a crash
    (b'{"prompt": "even :", "x": ' + b"[" * 50000 + b"]" * 50000 + b"}", "too_deep", {}),
]


@pytest.mark.parametrize("line, reason, options", BAD_ROWS, ids=[f"{r}-{i}" for i, (_, r, _) in enumerate(BAD_ROWS)])
def test_each_bad_row_is_counted_under_its_reason(tmp_path, tok, line, reason, options):
    good, other = json.dumps(GOOD).encode(), json.dumps({**GOOD, "target": "other"}).encode()
    path = write_lines(tmp_path / "d.jsonl", [good, line, other])
    ds = PromptDataset.from_file(path, tok, **options)
    assert ds.report() == {reason: 1}
    assert len(ds) == (3 if reason == "truncated" else 2)
    assert f"{reason} 1 (line 2)" in ds.summary()
    assert reason in REASONS


def test_all_bad_rows_in_one_file(tmp_path, tok):
    plain = [(line, reason) for line, reason, options in BAD_ROWS if not options]
    lines, expected = [], {}
    for i, (line, reason) in enumerate(plain):
        lines += [json.dumps({**GOOD, "id": i}).encode(), line]
        expected[reason] = expected.get(reason, 0) + 1
    ds = PromptDataset.from_file(write_lines(tmp_path / "d.jsonl", lines), tok)
    assert len(plain) >= 20
    assert ds.report() == expected and len(ds) == len(plain)
    summary = ds.summary()
    assert summary.startswith(f"{tmp_path / 'd.jsonl'}: kept {len(plain)} of {2 * len(plain)} rows; ")
    assert "non_utf8 2 (line 2, line 4)" in summary
    assert "non_string_prompt 6 (line 28, line 30, line 34, +3 more)" in summary
