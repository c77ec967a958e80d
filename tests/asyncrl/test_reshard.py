"""``verl_ds.asyncrl.reshard``: every saved rank's queued groups, prompts in flight and sampler slices dealt to another
world size in the order the saved run would have trained them. The expected steps come from the sampler alone at
world size 1 (its global batches are the same at every world size)."""
import pytest

from verl_ds.asyncrl.reshard import rank_part, reshard
from verl_ds.sampler import DistributedPromptSampler

N, G = 20, 4  # prompts, global batch


def _global_batches(k: int) -> list:
    one = DistributedPromptSampler(N, G, 0, 1, seed=3)
    return [one.next_batch() for _ in range(k)]


def _sampler(rank: int, world: int, drawn: int) -> dict:
    s = DistributedPromptSampler(N, G // world, rank, world, seed=3)
    for _ in range(drawn):
        s.next_batch()
    return s.state_dict()


def _group(index: int) -> dict:  # a queued group's saved state, reduced to what dealing looks at
    return {"index": index, "versions": [index]}


def _flat(part: dict) -> list:
    return [x["index"] if isinstance(x, dict) else x for x in part["queue"] + part["redo"]]


def test_two_ranks_to_one_keeps_each_steps_prompts_and_the_groups_samples():
    b = _global_batches(6)  # steps 1, 2 trained batches 0, 1; rank 0 drew batch 3 already, rank 1 only batch 2
    ranks = [{"queue": [_group(b[2][0]), _group(b[2][1]), _group(b[3][0])], "inflight": [[b[3][1], 3]], "redo": [],
              "sampler": _sampler(0, 2, 4)},
             {"queue": [_group(b[2][2])], "inflight": [[b[2][3], 3]], "redo": [], "sampler": _sampler(1, 2, 3)}]
    (part,), notes = reshard(ranks, 1)
    assert _flat(part) == b[2] + b[3]  # step 3 = batch 2, step 4 = batch 3 (rank 1's slice drawn now)
    assert part["queue"] == [_group(i) for i in b[2][:3]]  # the groups before the first prompt, as saved
    assert part["redo"] == [b[2][3], _group(b[3][0]), b[3][1], b[3][2], b[3][3]]  # a group after a prompt: in turn
    resumed = DistributedPromptSampler(N, G, 0, 1, seed=3)
    resumed.load_state_dict(part["sampler"])
    assert resumed.next_batch() == b[4] and resumed.next_batch() == b[5]
    assert notes == ["the asynchronous rollout state of 2 rank(s) dealt to 1: 4 queued group(s) kept with their "
                     "samples, 4 prompt(s) to generate, then global batch 4 of the sampler"]


def test_one_rank_to_two_deals_each_step_as_the_sampler_splits_a_batch():
    b = _global_batches(5)
    # b[1][2] went stale at step 2 (generated again: rollout.stale_samples=regenerate); b[2][0] took its place
    ranks = [{"queue": [_group(i) for i in b[2][1:]] + [_group(b[3][0])], "inflight": [[i, 3] for i in b[3][1:]],
              "redo": [b[1][2]], "sampler": _sampler(0, 1, 4)}]
    parts, notes = reshard(ranks, 2)
    # step 3: b[2][1:] + b[3][0], step 4: b[3][1:] + b[1][2], each split in two halves
    assert [_flat(p) for p in parts] == [[b[2][1], b[2][2], b[3][1], b[3][2]], [b[2][3], b[3][0], b[3][3], b[1][2]]]
    assert [len(p["queue"]) for p in parts] == [2, 2] and notes[0].endswith("then global batch 4 of the sampler")
    for rank, p in enumerate(parts):
        s = DistributedPromptSampler(N, G // 2, rank, 2, seed=3)
        s.load_state_dict(p["sampler"])
        assert s.next_batch() == b[4][2 * rank:2 * rank + 2]


def test_ranks_offset_by_dropped_groups_keep_the_common_steps_and_lose_no_prompt():
    b = _global_batches(6)
    # rank 0 dropped one stale group of batch 2 (rollout.stale_samples=drop): one prompt short of rank 1
    ranks = [{"queue": [_group(b[2][1])], "inflight": [], "redo": [], "sampler": _sampler(0, 2, 3)},
             {"queue": [_group(i) for i in b[2][2:]], "inflight": [], "redo": [], "sampler": _sampler(1, 2, 3)}]
    (part,), notes = reshard(ranks, 1)
    got = _flat(part)
    assert sorted(got[:4]) == sorted([b[2][1], b[3][0]] + b[2][2:])  # step 3 as the saved run: rank 0 drew on
    resumed = DistributedPromptSampler(N, G, 0, 1, seed=3)
    resumed.load_state_dict(part["sampler"])
    after = got + resumed.next_batch()
    assert sorted(after) == sorted([b[2][1]] + b[2][2:] + b[3] + b[4])  # nothing lost, nothing twice
    assert len(notes) == 2 and "dropped stale groups in unequal numbers" in notes[1]


def test_a_global_batch_the_new_world_cannot_split_is_refused():
    ranks = [{"queue": [], "inflight": [], "redo": [], "sampler": _sampler(0, 2, 2)},
             {"queue": [], "inflight": [], "redo": [], "sampler": _sampler(1, 2, 2)}]
    with pytest.raises(ValueError, match="global batches of 4 prompts, which 3 ranks cannot split evenly"):
        reshard(ranks, 3)


def test_rank_part_at_the_saved_world_size_generates_the_prompts_in_flight_first():
    b = _global_batches(4)
    rng = {"torch": "saved stream"}
    ranks = [{"queue": [_group(b[2][0])], "inflight": [[b[2][1], 2]], "redo": [b[1][3]], "sampler": _sampler(0, 2, 3),
              "rng": rng},
             {"queue": [], "inflight": [[b[2][2], 2], [b[2][3], 3]], "redo": [], "sampler": _sampler(1, 2, 3)}]
    state = {"mode": "streaming", "world_size": 2, "ranks": ranks}
    part, notes = rank_part(state, 2, 0)
    assert notes == []
    assert part["queue"] == [_group(b[2][0])] and part["inflight"] == []  # in flight: to generate again, once
    assert part["redo"] == [b[2][1], b[1][3]] and part["sampler"] == _sampler(0, 2, 3) and part["rng"] == rng
    part, _ = rank_part(state, 2, 1)
    assert part["redo"] == [b[2][2], b[2][3]] and "rng" not in part


def test_rank_part_at_another_world_size_is_that_ranks_share_of_the_reshard():
    b = _global_batches(4)
    ranks = [{"queue": [_group(b[2][0])], "inflight": [[b[2][1], 2]], "redo": [], "sampler": _sampler(0, 2, 3),
              "rng": {"torch": "rank 0's stream"}},
             {"queue": [], "inflight": [[b[2][2], 2], [b[2][3], 3]], "redo": [], "sampler": _sampler(1, 2, 3)}]
    part, notes = rank_part({"mode": "streaming", "world_size": 2, "ranks": ranks}, 1, 0)
    assert _flat(part) == b[2] and "rng" not in part  # the saved streams belong to the saved ranks' slices
    assert "dealt to 1" in notes[0]
