"""The bounded sample queue (back-pressure, staleness admission, its metrics and state) and the weight gate that lets
a weight update land between two decoding steps of a real HF generate on another thread."""
import threading
import time

import pytest
import torch

from verl_ds.asyncrl.stream import WeightGate
from verl_ds.asyncrl.queue import Group, ProducerError, SampleQueue
from verl_ds.batch import RolloutBatch


def _group(index: int, version: int, length: int, n: int = 2, R: int = 6) -> Group:
    """n samples of ``length`` tokens, every token of version ``version`` (past the end: -1)."""
    prompt = torch.full((n, 2), 5)
    resp = torch.full((n, R), 7)
    resp[:, length - 1] = 1  # EOS
    b = RolloutBatch.from_generation(prompt, torch.ones_like(prompt, dtype=torch.bool), resp, pad_token_id=0,
                                     eos_token_id=1, extras={"prompt": [f"p{index}"] * n})
    b.scores = torch.zeros(n, R)
    v = torch.where(torch.arange(R)[None, :] < length, torch.full((n, R), version), torch.full((n, R), -1))
    return Group(batch=b, responses=["x"] * n, index=index, versions=v)


def test_a_full_queue_blocks_the_producer_and_never_grows():
    q = SampleQueue(capacity=3)
    produced, sizes = [], []

    def producer():
        for i in range(12):
            q.put(_group(i, 0, 3))
            produced.append(i)
            sizes.append(len(q))

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    time.sleep(0.3)
    assert len(produced) == 3 and t.is_alive()  # blocked on the 4th put: back-pressure, not growth
    taken = []
    while len(taken) < 12:
        groups, _ = q.take(2, version=0, max_staleness=0, policy="drop", timeout=10)
        taken += [g.index for g in groups]
        time.sleep(0.02)  # a slow trainer
    t.join(5)
    assert taken == list(range(12)) and max(sizes) <= 3 and q.high_water == 3 and q.blocked_s > 0.2


@pytest.mark.parametrize("policy", ["drop", "regenerate"])
def test_admission_by_staleness_and_its_metrics(policy):
    """Trainer at version 5, bound 1: versions 3 (too old, long) and 4, 5 (kept, short); hand-computed metrics."""
    q = SampleQueue(capacity=8)
    for index, version, length in [(0, 3, 6), (1, 4, 2), (2, 5, 4), (3, 3, 6), (4, 5, 2)]:
        q.put(_group(index, version, length))
    redo = []
    kept, m = q.take(3, version=5, max_staleness=1, policy=policy, timeout=5, on_stale=lambda g: redo.append(g.index))
    assert [g.index for g in kept] == [1, 2, 4]
    assert redo == ([0, 3] if policy == "regenerate" else [])
    assert float(m["async/stale_groups"]) == 2
    assert float(m["async/dropped"]) == (2 if policy == "drop" else 0)
    assert float(m["async/regenerated"]) == (2 if policy == "regenerate" else 0)
    assert float(m["async/staleness/mean"]) == pytest.approx(1 / 3) and float(m["async/staleness/max"]) == 1
    assert float(m["async/staleness_hist/0"]) == 2 and float(m["async/staleness_hist/1"]) == 1
    assert float(m["async/length_stale"]) == 6 and float(m["async/length_kept"]) == pytest.approx(8 / 3)
    assert float(m["async/queue_len"]) == 0


def test_partial_rollout_group_is_as_old_as_its_oldest_token():
    g = _group(0, 4, 5)
    g.versions[:, 3:5] = 6  # a weight update landed after the third token
    assert g.oldest() == 4
    q = SampleQueue(capacity=2)
    q.put(g)
    kept, m = q.take(1, version=6, max_staleness=2, policy="drop", timeout=5)
    assert kept and float(m["async/staleness/max"]) == 2
    q.put(g)
    with pytest.raises(ProducerError, match="no sample from the rollout producer for 0 s"):
        q.take(1, version=7, max_staleness=2, policy="drop", timeout=0.2)  # dropped, then nothing else comes


def test_a_failed_producer_is_reported_with_its_error_and_the_state_round_trips():
    q = SampleQueue(capacity=4, name="rank 1")
    q.put(_group(7, 2, 3))
    saved = q.snapshot()
    q.close(RuntimeError("reward function exploded"))
    assert len(q.take(1, 2, 0, "drop", 5)[0]) == 1  # what was queued is still handed out
    with pytest.raises(ProducerError, match="rank 1: generation stopped .*RuntimeError: reward function exploded"):
        q.take(1, 2, 0, "drop", 5)
    with pytest.raises(ProducerError, match="closed"):
        q.put(_group(8, 2, 3))
    r = SampleQueue(capacity=4)
    r.restore(saved)
    (g,), _ = r.take(1, 2, 0, "drop", 5)
    assert g.index == 7 and torch.equal(g.versions, _group(7, 2, 3).versions)
    assert torch.equal(g.batch.action, _group(7, 2, 3).batch.action) and g.batch.extras["prompt"] == ["p7"] * 2


def test_a_weight_update_lands_between_decoding_steps_of_a_real_generate():
    """HF generate on a tiny Llama in a thread; the trainer's update (a real weight change of the model) waits for
    the next decoding step; tokens before it carry version 0, after it version 1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from verl_ds.generation import HFRolloutEngine

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2, eos_token_id=31,
                                         pad_token_id=0, bos_token_id=None))
    engine = HFRolloutEngine(model, pad_token_id=0, eos_token_id=31, gather_params=False)
    gate = WeightGate(0, mid_response=True)
    started, steps = threading.Event(), []

    def hook():
        steps.append(threading.get_ident())
        if len(steps) == 3:
            started.set()
            time.sleep(0.2)  # the update below is waiting now
        return gate.hook()

    engine.step_hook = hook
    out = {}

    def producer():
        gate.producer = threading.get_ident()
        with gate.cond:
            out["gen"] = engine.generate(torch.tensor([[3, 4, 5]]), torch.ones(1, 3, dtype=torch.bool),
                                         max_new_tokens=12, temperature=1.0)
        out["versions"] = engine.last_versions[threading.get_ident()]

    t = threading.Thread(target=producer)
    t.start()
    assert started.wait(30)
    gate.update(refresh=lambda: [p.data.mul_(0.5) for p in model.parameters()])
    t.join(30)
    v = out["versions"]
    assert gate.version == 1 and len(v) == 12
    assert v[:3] == [0, 0, 0] and v[4:] == [1] * 8  # the update landed at the 4th step's boundary at the latest
    assert v == sorted(v)


def test_a_take_that_fails_part_way_puts_what_it_had_taken_back_at_the_front():
    """2 of 3 groups taken when the producer fails: ProducerError, and the 2 are back, first, in their order (a
    checkpoint written after the failure holds them); give_back of a later failed step does the same."""
    q = SampleQueue(capacity=4, name="rank 0")
    for i in (0, 1):
        q.put(_group(i, 0, 3))
    counted, returned = [], []
    threading.Timer(0.2, lambda: q.close(RuntimeError("reward function exploded"))).start()
    with pytest.raises(ProducerError, match="generation stopped .*reward function exploded"):
        q.take(3, 0, 0, "drop", 5, on_kept=lambda g: counted.append(g.index),
               on_returned=lambda gs: returned.extend(g.index for g in gs))
    assert counted == [0, 1] and returned == [0, 1]
    assert [s["index"] for s in q.snapshot()] == [0, 1]
    r = SampleQueue(capacity=2)
    r.restore([_group(i, 0, 3).to_state() for i in (5, 6, 7)])
    taken, _ = r.take(2, 0, 0, "drop", 5)
    r.give_back(taken)
    assert [s["index"] for s in r.snapshot()] == [5, 6, 7]
