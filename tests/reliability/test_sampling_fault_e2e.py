"""A draw that fails (NaN logits while sampling, ``torch.multinomial`` refuses them) on one of two ranks: the step
is skipped on both with a forensic record naming the sampling, and the next step trains from the same weights."""
import json
import os

import pytest

from e2e_utils import base_env, read_metrics, run_train
from verl_ds.testing.faults import FAULT_ENV

pytestmark = pytest.mark.slow  # a real two-rank training run


def test_a_failed_draw_on_one_rank_skips_the_step_on_both(tmp_path):
    out = str(tmp_path / "run")
    proc = run_train(out, ["trainer.total_steps=3", "trainer.max_bad_steps=2", "trainer.export=none"], nproc=2,
                     env=base_env(**{FAULT_ENV: "nan_logits_at_step=2:rank=1:phase=sampling"}))
    assert "NaN logits (sample 0, response position 0, sampling forward) at step 2, rank 1" in proc.stderr
    rows = {m["step"]: m for m in read_metrics(out) if "training/global_step" in m}
    assert sorted(rows) == [1, 2, 3]
    # FAST: 8 samples a step in mini-batches of 4: 2 updates of the actor and 2 of the critic, all skipped
    assert [rows[s]["training/skipped_updates"] for s in (1, 2, 3)] == [0, 4, 0]
    assert [rows[s]["training/nonfinite_steps"] for s in (1, 2, 3)] == [0, 1, 1]
    assert [rows[s]["training/consecutive_bad_steps"] for s in (1, 2, 3)] == [0, 1, 0]
    assert "actor/pg_loss" not in rows[2]
    for s in (1, 3):
        loss = rows[s]["actor/pg_loss"]
        assert isinstance(loss, float) and loss == loss
    record = json.load(open(os.path.join(out, "nonfinite", "step_2.json")))
    assert (record["kind"], record["origin"], record["world_size"], record["samples"]) == ("batch", "sampling", 2, [])
    assert "probability tensor contains" in record["hint"]
    assert os.listdir(os.path.join(out, "nonfinite")) == ["step_2.json"]
