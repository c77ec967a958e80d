"""benchmarks/distill.py without training: its student overrides load, and its one line and exit status follow the
parity scores of the first and last 10% of the student's steps (``train`` replaced by a writer of metrics)."""
import json
import os

from benchmark_scripts import load_benchmark

from verl_ds.config import load_config


def test_the_student_overrides_are_a_valid_distillation_config(tmp_path):
    bench = load_benchmark("distill")
    cfg = load_config(overrides=[*bench.STUDENT, f"distill.teacher_path={tmp_path}"])
    assert cfg.reward.functions == [] and cfg.distill.mode == "advantage"


def test_the_line_and_the_exit_status(tmp_path, monkeypatch, capsys):
    bench = load_benchmark("distill")
    calls = []

    def fake_train(out_dir, overrides, timeout_s):
        calls.append((os.path.basename(out_dir), overrides))
        os.makedirs(out_dir)
        scores = [0.3] * 2 + [0.5] * 16 + [0.9, 0.8]  # 20 steps: the first and last two are the 10%
        with open(os.path.join(out_dir, "metrics.jsonl"), "w") as fh:
            fh.write(json.dumps({"step": 0, "val/score/mean": 0.0}) + "\n")
            for step, s in enumerate(scores, 1):
                fh.write(json.dumps({"step": step, "reward/parity/mean": s}) + "\n")
        return 12.5

    monkeypatch.setattr(bench, "train", fake_train)
    assert bench.main(["--teacher", str(tmp_path / "missing"), "--work-dir", str(tmp_path), "--",
                       "trainer.total_steps=20", "actor.lr=1e-2"]) == 0
    assert capsys.readouterr().out.strip() == "distill score_first=0.300 score_last=0.850 seconds=12.5"
    assert [c[0] for c in calls] == ["teacher", "student"]  # no teacher directory: the default job makes one
    student = calls[1][1]
    assert student[-2:] == ["trainer.total_steps=20", "actor.lr=1e-2"] and "actor.lr=5e-3" not in student
    assert any(o.startswith("distill.teacher_path=") for o in student)
    load_config(overrides=student)  # no key given twice
    calls.clear()
    # an existing teacher directory is used as it is; 0.85 < 0.9: exit 1
    assert bench.main(["--teacher", str(tmp_path), "--work-dir", str(tmp_path), "--min-score", "0.9"]) == 1
    assert [c[0] for c in calls] == ["student"]
