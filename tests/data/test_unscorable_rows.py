"""Rows the reward functions cannot score are found before training (issue 12: such a row used to kill the run at
step 2), dropped and counted under "unscorable" with their locations."""
import json

import pytest

from verl_ds.data import PromptDataset
from verl_ds.rewards import unscorable_rows
from verl_ds.tokenizer import build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


def _dataset(tmp_path, tok, rows):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptDataset.from_file(str(path), tok)


def test_rows_exact_match_cannot_score_are_dropped_and_counted(tmp_path, tok):
    rows = [{"prompt": f"what is {i} plus 1 ?", "answer": str(i + 1)} for i in range(300)]
    rows[7]["answer"] = "seven-ish"  # not a number: exact_match raises on it
    rows[260]["answer"] = None
    ds = _dataset(tmp_path, tok, rows)
    bad = unscorable_rows(ds, ["exact_match"])
    assert sorted(bad) == [7, 260]
    assert "exact_match: ValueError" in bad[7] and "is not a number" in bad[7]
    ds.drop(bad, "unscorable")
    assert len(ds) == 298 and ds.report() == {"unscorable": 2}
    assert "unscorable 2 (line 8, line 261)" in ds.summary()
    assert [item["answer"] for item in ds.items[6:8]] == ["7", "9"]  # the neighbours stay, in order


def test_a_missing_field_makes_every_row_unscorable_and_per_token_functions_are_not_called(tmp_path, tok):
    ds = _dataset(tmp_path, tok, [{"prompt": "what is 1 plus 1 ?"}] * 3)
    assert sorted(unscorable_rows(ds, ["exact_match"])) == [0, 1, 2]
    assert unscorable_rows(ds, [{"name": "exact_match", "per_token": True}]) == {}
    assert sorted(unscorable_rows(ds, ["parity"])) == [0, 1, 2]  # no even/odd instruction in these prompts
    assert unscorable_rows(_dataset(tmp_path, tok, [{"prompt": "even : 1 2 =>"}] * 3), ["parity"]) == {}
    with pytest.raises(ValueError, match="unknown reason"):
        ds.drop([0], "bad")
