"""Rule-based rewards on hostile model text: math_verify in worker processes killed past a timeout (scored 0,
counted in reward/math_verify/timed_out) while the trainer's other threads run on; parallel scoring equals serial."""
import json
import os
import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from verl_ds.config import ConfigError, load_config
from verl_ds.config.schema import RewardConfig
from verl_ds.models import RewardFunctionError, RewardModel
from verl_ds.rewards import RewardBatch
from verl_ds import verifiable
from verl_ds.verifiable import DEFAULT_MATH_TIMEOUT_S, Scores, math_answer_reward, set_math_verify_timeout

from test_verifiable import MATH_CASES, needs_math

# sympy evaluates 9^(9^(9^9)) in one C call that holds the GIL: it never ends (killed after 400 s in a real run)
TOWER = "So the answer is \\boxed{9^{9^{9^{9}}}}"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def short_timeout():
    set_math_verify_timeout(2.0)  # small, so the hostile answer is cut quickly; benign checks take milliseconds
    yield
    set_math_verify_timeout(DEFAULT_MATH_TIMEOUT_S)


@needs_math
def test_power_tower_is_killed_while_other_threads_run():
    # In a child interpreter: before the worker processes, this call held the GIL for good, and no test timeout
    # inside the same process could have fired.
    script = textwrap.dedent(r"""
        import json, threading, time
        from verl_ds.rewards import RewardBatch
        from verl_ds.verifiable import math_answer_reward, set_math_verify_timeout

        set_math_verify_timeout(2.0)
        ticks, out = [0], {}

        def count():
            while True:
                ticks[0] += 1
                time.sleep(0.001)

        def score():  # on a reward thread, as RewardModel(num_workers > 1) calls it
            math_answer_reward(["q"], ["\\boxed{72}"], RewardBatch({"answer": ["72"]}))  # a warm worker
            before = ticks[0]
            got = math_answer_reward(["q"] * 3, [%r, "\\boxed{72}", "\\boxed{73}"],
                                     RewardBatch({"answer": ["72"] * 3}))
            out.update(scores=list(got), timed_out=got.metrics["timed_out"], ticks=ticks[0] - before)

        threading.Thread(target=count, daemon=True).start()
        worker = threading.Thread(target=score)
        worker.start()
        worker.join()
        print(json.dumps(out))
    """ % TOWER)
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["scores"] == [0.0, 1.0, 0.0] and out["timed_out"] == [1.0, 0.0, 0.0]
    assert out["ticks"] >= 20  # the counting thread kept running during the scoring (a held GIL: 0 or 1)


@needs_math
def test_timed_out_answer_through_the_reward_model(short_timeout):
    from verl_ds.batch import RolloutBatch

    B = 4
    batch = RolloutBatch.from_generation(torch.full((B, 2), 5), torch.ones(B, 2, dtype=torch.bool),
                                         torch.full((B, 3), 7), pad_token_id=0, eos_token_id=1,
                                         extras={"answer": ["72", "72", "1/2", "72"]})
    responses = ["\\boxed{72}", TOWER, "so x = 0.5", "\\boxed{71}"]
    rm = RewardModel(num_workers=2)  # two chunks, two reward threads, their own worker processes
    rm.register_reward_fn(math_answer_reward, name="math_verify")
    per_sample = {}
    scores, metrics = rm.compute_rewards(batch, ["q"] * B, responses, per_sample=per_sample)
    assert scores.sum(-1).tolist() == [1.0, 0.0, 1.0, 0.0]
    assert per_sample["reward/math_verify/timed_out"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert float(metrics["reward/math_verify/timed_out"]) == 0.25 and float(metrics["reward/math_verify/mean"]) == 0.5
    # the killed worker was replaced: the next check scores as usual
    assert math_answer_reward(["q"], ["\\boxed{72}"], RewardBatch({"answer": ["72"]})) == [1.0]


@needs_math
def test_parallel_scoring_equals_one_by_one():
    responses = [r for r, _, _ in MATH_CASES] * 3
    answers = [a for _, a, _ in MATH_CASES] * 3
    one_by_one = [math_answer_reward(["q"], [r], RewardBatch({"answer": [a]}))[0] for r, a in zip(responses, answers)]
    assert one_by_one == [e for _, _, e in MATH_CASES] * 3  # the hand-written expectations
    chunks = [(lo, lo + 7) for lo in range(0, len(responses), 7)]
    start = threading.Barrier(len(chunks))

    def score(bounds):
        lo, hi = bounds
        start.wait()  # every thread asks at once: each needs a worker of its own (no lock across them)
        return math_answer_reward(["q"] * (hi - lo), responses[lo:hi], RewardBatch({"answer": answers[lo:hi]}))

    with ThreadPoolExecutor(max_workers=len(chunks)) as pool:
        parallel = [s for part in pool.map(score, chunks) for s in part]
    assert parallel == one_by_one
    assert verifiable._POOL.size() >= min(2, verifiable._POOL.max_workers)


def test_timeout_key_and_setter():
    assert RewardConfig().math_verify_timeout_s == DEFAULT_MATH_TIMEOUT_S == 5.0
    assert load_config(overrides=["reward.math_verify_timeout_s=0.5"]).reward.math_verify_timeout_s == 0.5
    with pytest.raises(ConfigError, match="reward.math_verify_timeout_s"):
        load_config(overrides=["reward.math_verify_timeout_s=0"])
    for bad in (0, -1.0, float("inf"), float("nan"), True, "5"):
        with pytest.raises(ValueError, match="math_verify timeout: expected a finite number of seconds > 0"):
            set_math_verify_timeout(bad)


def test_side_metrics_are_checked():
    from verl_ds.batch import RolloutBatch

    batch = RolloutBatch.from_generation(torch.full((2, 2), 5), torch.ones(2, 2, dtype=torch.bool),
                                         torch.full((2, 3), 7), pad_token_id=0, eos_token_id=1)
    for metrics, message in (({"n": [1.0]}, r"side metric 'n': expected a name without '/' and a list of 2 floats"),
                             ({"a/b": [1.0, 1.0]}, r"side metric 'a/b'"),
                             ({"n": [1.0, float("nan")]}, "non-finite")):
        rm = RewardModel()
        rm.register_reward_fn(lambda p, r, b, m=metrics: Scores([1.0, 0.0], m), name="f")
        with pytest.raises(RewardFunctionError, match=message):
            rm.compute_rewards(batch, ["q"] * 2, ["a", "b"])
