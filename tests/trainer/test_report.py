"""verl_ds.report: the end-of-run summary covers the whole run after a resume and names its steps.

data/metrics_requeued_at_step9.jsonl is the metrics.jsonl of a real run: the default job, 30 steps, 2 ranks
under Slurm (slurm/train.sbatch), sent USR1 after step 9, requeued, resumed from the step-9 checkpoint. It
was logged before the train score was renamed from critic/score/mean to rollout/score/mean."""
import json
import os
import shutil

import pytest

from verl_ds.report import by_step, format_summary, read_metrics_file, summarize

REAL = os.path.join(os.path.dirname(__file__), "data", "metrics_requeued_at_step9.jsonl")


def reference(path: str):
    """A float64 loop over the file: (train steps, their scores, validation (step, score) pairs)."""
    steps, scores, val = [], [], []
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            row = json.loads(line)
            if "critic/score/mean" in row:
                steps.append(row["step"])
                scores.append(float(row["critic/score/mean"]))
            if "val/score/mean" in row:
                val.append((row["step"], row["val/score/mean"]))
    return steps, scores, val


def mean(xs):
    total = 0.0
    for x in xs:
        total += x
    return total / len(xs)


@pytest.fixture
def resumed_run(tmp_path):
    shutil.copy(REAL, tmp_path / "metrics.jsonl")
    return tmp_path


def test_resumed_run_summary_covers_every_step_of_the_file(resumed_run):
    steps, scores, val = reference(REAL)
    assert steps == list(range(1, 31)) and [s for s, _ in val] == [0, 25, 30]
    # what this session trained: the history of a process that resumed from step 9
    session = [r for r in read_metrics_file(REAL) if r["step"] > 9]
    s = summarize(session, 30, elapsed=12.5, tokens=2500.0, output_dir=str(resumed_run), export_dir=None,
                  plot=False, write=True, resumed_from=9)
    assert s["metrics_file"] == str(resumed_run / "metrics.jsonl")
    assert s["train_steps"] == [1, 30] and s["train_rows"] == 30
    assert s["reward_first10_steps"] == [1, 3] and s["reward_last10_steps"] == [28, 30]
    assert s["reward_first10"] == pytest.approx(mean(scores[:3]), abs=1e-12)
    assert s["reward_last10"] == pytest.approx(mean(scores[-3:]), abs=1e-12)
    assert (s["val_before_step"], s["val_before"]) == val[0] and (s["val_after_step"], s["val_after"]) == val[-1]
    assert s["session_steps"] == [10, 30] and s["resumed_from"] == 9 and s["tokens_per_s"] == 200.0
    with open(resumed_run / "summary.json", encoding="utf-8") as fh:
        assert json.load(fh) == s


def test_the_session_history_alone_would_report_other_steps(resumed_run):
    """Why the file matters: the first 10% of the steps after the resume are steps 10-11, another figure."""
    _, scores, _ = reference(REAL)
    session = [r for r in read_metrics_file(REAL) if r["step"] > 9]
    empty = resumed_run / "no_metrics_here"
    empty.mkdir()
    s = summarize(session, 30, 1.0, 0.0, str(empty), None, plot=False, write=False, resumed_from=9)
    assert s["metrics_file"] is None and s["reward_first10_steps"] == [10, 11]
    assert s["reward_first10"] == pytest.approx(mean(scores[9:11]), abs=1e-12)
    assert abs(s["reward_first10"] - mean(scores[:3])) > 0.05


def test_without_a_file_the_history_is_used(tmp_path):
    history = [{"step": 0, "val/score/mean": 0.25}] + [{"step": i, "rollout/score/mean": i / 100} for i in range(1, 21)]
    s = summarize(history, 20, 2.0, 100.0, str(tmp_path), None, plot=False, write=False, resumed_from=0)
    # hand-computed: 20 steps -> 2 per tenth; (0.01 + 0.02) / 2 and (0.19 + 0.20) / 2
    assert s["reward_first10"] == pytest.approx(0.015) and s["reward_first10_steps"] == [1, 2]
    assert s["reward_last10"] == pytest.approx(0.195) and s["reward_last10_steps"] == [19, 20]
    assert (s["val_before_step"], s["val_after_step"]) == (0, 0) and s["session_steps"] == [1, 20]
    assert s["tokens_per_s"] == 50.0


def test_a_step_logged_twice_counts_once_with_its_latest_values(tmp_path):
    """A file appended after a resume without truncation holds steps 3-4 twice: the later rows win."""
    rows = [{"step": s, "rollout/score/mean": v} for s, v in [(1, 0.1), (2, 0.2), (3, 0.9), (4, 0.9), (3, 0.3),
                                                              (4, 0.4), (5, 0.5)]]
    rows.append({"step": 5, "val/score/mean": 0.7})  # a separate validation row of step 5 is merged into it
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    merged = by_step(read_metrics_file(str(tmp_path / "metrics.jsonl")))
    assert [(r["step"], r["rollout/score/mean"]) for r in merged] == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4), (5, 0.5)]
    s = summarize([], 5, 1.0, 0.0, str(tmp_path), None, plot=False, write=False)
    assert s["train_rows"] == 5 and s["reward_first10"] == 0.1 and s["reward_last10"] == 0.5
    assert (s["val_after_step"], s["val_after"]) == (5, 0.7)
    assert s["session_steps"] is None  # the trainer did not say where the session started


def test_a_line_cut_by_a_crash_is_skipped_but_a_bad_line_inside_is_an_error(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "critic/score/mean": 0.5}\n{"step": 2, "critic/sc')
    assert [r["step"] for r in read_metrics_file(str(path))] == [1]
    path.write_text('{"step": 1, "critic/score/mean": 0.5}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 2 is not JSON: 'not json'"):
        read_metrics_file(str(path))
    with pytest.raises(ValueError, match=r"a metrics row has no 'step': \['critic/score/mean'\]"):
        by_step([{"critic/score/mean": 0.5}])


def test_resume_truncates_a_metrics_file_whose_last_line_a_crash_cut(tmp_path):
    from verl_ds.metrics import MetricsLogger

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "x": 0.5}\n{"step": 2, "x": 0.25}\n{"step": 3, "x": 0.')  # killed mid-line
    logger = MetricsLogger(str(tmp_path), enabled=True)
    logger.truncate_after(1)  # resumed from the step-1 checkpoint
    logger.log(2, {"x": 0.75})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 1, "x": 0.5},
                                                                             {"step": 2, "x": 0.75}]


def test_printed_summary_names_the_steps_of_each_figure(resumed_run):
    _, scores, _ = reference(REAL)
    session = [r for r in read_metrics_file(REAL) if r["step"] > 9]
    s = summarize(session, 30, 12.5, 2500.0, str(resumed_run), "/x/hf_actor", plot=False, write=False,
                  resumed_from=9)
    text = format_summary(s)
    first, last = mean(scores[:3]), mean(scores[-3:])
    assert "steps: 30   this session (steps 10-30, resumed from step 9): 12.5 s, 200 tokens/s" in text
    assert (f"train reward: steps 1-3 (first 10% of 30 steps) {first:.3f} -> steps 28-30 (last 10%) {last:.3f} "
            f"({last - first:+.3f})") in text
    assert "validation reward (greedy): step 0 0.359 -> step 30 1.000" in text
    assert "HF export: /x/hf_actor" in text
    done = dict(s, session_steps=[], resumed_from=30)
    assert "this session (no step left to train, resumed from step 30): " in format_summary(done)
    unknown = dict(s, session_steps=None)
    assert "steps: 30   this session: 12.5 s" in format_summary(unknown)


def test_reward_curve_is_a_png_of_the_whole_run(resumed_run):
    pytest.importorskip("matplotlib")
    s = summarize([], 30, 1.0, 0.0, str(resumed_run), None, plot=True, write=True, resumed_from=9)
    with open(s["reward_curve"], "rb") as fh:
        assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_a_run_resumed_across_the_score_rename_reports_every_step(tmp_path):
    """Steps 1-2 logged as critic/score/mean (before the rename), 3-4 as rollout/score/mean (after)."""
    rows = [{"step": 1, "critic/score/mean": 0.2}, {"step": 2, "critic/score/mean": 0.4},
            {"step": 3, "rollout/score/mean": 0.6}, {"step": 4, "rollout/score/mean": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = summarize([], 4, 1.0, 0.0, str(tmp_path), None, plot=False, write=False, resumed_from=2)
    assert s["train_steps"] == [1, 4] and s["reward_first10"] == 0.2 and s["reward_last10"] == 1.0
    assert s["session_steps"] == [3, 4]
