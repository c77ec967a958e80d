"""DistributedPromptSampler (sharding, determinism, exact resume) and collate_prompts (left padding)."""
import numpy as np
import pytest
import torch

from verl_ds.data import collate_prompts
from verl_ds.sampler import DistributedPromptSampler


def reference_batches(n, bs, world, seed, steps, drop_last=True):
    """Obviously-correct: concatenate the epochs' permutations, cut into global batches, split by rank."""
    g = bs * world
    per_epoch = n // g if drop_last or n % g == 0 else n // g + 1
    out, epoch = [], 0
    while len(out) < steps:
        perm = list(np.random.default_rng([seed, epoch]).permutation(n))
        perm += perm[:g]  # wrap (only used without drop_last)
        for b in range(per_epoch):
            out.append([perm[b * g + r * bs: b * g + (r + 1) * bs] for r in range(world)])
        epoch += 1
    return out[:steps]


@pytest.mark.parametrize("n, bs, world, drop_last", [(20, 3, 2, True), (20, 3, 2, False), (12, 4, 3, True),
                                                     (7, 7, 1, True), (10, 2, 4, False)])
def test_shards_match_reference_and_partition_each_global_batch(n, bs, world, drop_last):
    steps = 9
    samplers = [DistributedPromptSampler(n, bs, r, world, seed=5, drop_last=drop_last) for r in range(world)]
    expected = reference_batches(n, bs, world, 5, steps, drop_last)
    for step in range(steps):
        shards = [s.next_batch() for s in samplers]
        assert shards == expected[step]
        flat = [i for shard in shards for i in shard]
        assert len(set(flat)) == len(flat) == bs * world  # ranks disjoint, union = the global batch
        assert all(isinstance(i, int) and 0 <= i < n for i in flat)


def test_each_epoch_covers_the_data_once():
    s = DistributedPromptSampler(24, 4, 0, 1, seed=1)
    assert s.batches_per_epoch == 6
    epoch0 = [i for _ in range(6) for i in s.next_batch()]
    epoch1 = [i for _ in range(6) for i in s.next_batch()]
    assert sorted(epoch0) == sorted(epoch1) == list(range(24))
    assert epoch0 != epoch1 and s.epoch == 1


def test_drop_last_and_wraparound_counts():
    assert DistributedPromptSampler(10, 2, 0, 2, drop_last=True).batches_per_epoch == 2
    assert DistributedPromptSampler(10, 2, 0, 2, drop_last=False).batches_per_epoch == 3
    assert DistributedPromptSampler(8, 2, 0, 2, drop_last=False).batches_per_epoch == 2


def test_deterministic_and_seed_dependent():
    a = DistributedPromptSampler(50, 4, 1, 2, seed=3)
    b = DistributedPromptSampler(50, 4, 1, 2, seed=3)
    assert [a.next_batch() for _ in range(20)] == [b.next_batch() for _ in range(20)]
    assert DistributedPromptSampler(50, 4, 1, 2, seed=3).next_batch() != \
        DistributedPromptSampler(50, 4, 1, 2, seed=4).next_batch()


@pytest.mark.parametrize("stop", [1, 4, 5, 6, 7])  # 5 batches per epoch: before, at and after the boundary
def test_resume_is_exact_across_an_epoch_boundary(stop):
    straight = [DistributedPromptSampler(21, 2, r, 2, seed=9) for r in range(2)]
    expected = [[s.next_batch() for s in straight] for _ in range(14)]
    first = [DistributedPromptSampler(21, 2, r, 2, seed=9) for r in range(2)]
    got = [[s.next_batch() for s in first] for _ in range(stop)]
    states = [s.state_dict() for s in first]
    assert set(states[0]) >= {"epoch", "position", "seed"}
    resumed = [DistributedPromptSampler(21, 2, r, 2, seed=123) for r in range(2)]  # saved seed wins
    for s, state in zip(resumed, states):
        s.load_state_dict(state)
    got += [[s.next_batch() for s in resumed] for _ in range(14 - stop)]
    assert got == expected


def test_state_dict_values():
    s = DistributedPromptSampler(10, 5, 0, 1, seed=2)
    assert s.state_dict() == {"epoch": 0, "position": 0, "seed": 2, "dataset_len": 10, "global_batch_size": 5}
    s.next_batch(), s.next_batch(), s.next_batch()
    assert (s.state_dict()["epoch"], s.state_dict()["position"]) == (1, 1)


@pytest.mark.parametrize("args, message", [
    ((3, 2, 0, 2), r"the data set has 3 prompts, fewer than one global batch \(2 per rank x 2 ranks = 4\)"),
    ((0, 1), "dataset_len: expected an int >= 1, got 0"),
    ((10, 0), "batch_size_per_rank: expected an int >= 1, got 0"),
    ((10, 2, 2, 2), "rank: expected 0 <= rank < world_size=2, got 2"),
    ((10, 2, -1, 2), "rank: expected an int >= 0, got -1"),
    ((10, 2, 0, 0), "world_size: expected an int >= 1, got 0"),
    ((10, 2, 0, 1, -3), "seed: expected an int >= 0, got -3"),
    ((10.0, 2), "dataset_len: expected an int >= 1, got 10.0"),
])
def test_sampler_argument_errors(args, message):
    with pytest.raises(ValueError, match=message):
        DistributedPromptSampler(*args)


@pytest.mark.parametrize("state, message", [
    ({"epoch": 0, "position": 0}, r"sampler state: missing keys \['seed'\]"),
    ({"epoch": 0, "position": 0, "seed": 0, "dataset_len": 11}, "saved dataset_len=11 but this run has 10"),
    ({"epoch": 0, "position": 0, "seed": 0, "global_batch_size": 4}, "saved global_batch_size=4 but this run has 2"),
    ({"epoch": 0, "position": 6, "seed": 0}, r"0 <= position <= 5; got epoch=0 position=6"),
    ({"epoch": -1, "position": 0, "seed": 0}, "got epoch=-1"),
])
def test_load_state_dict_errors(state, message):
    with pytest.raises(ValueError, match=message):
        DistributedPromptSampler(10, 2).load_state_dict(state)


def test_collate_left_pads():
    items = [{"input_ids": [5, 6, 7], "prompt": "a", "answer": "1"},
             {"input_ids": [8], "prompt": "b", "id": 4}]
    out = collate_prompts(items, pad_token_id=0)
    assert out["input_ids"].dtype == torch.int64 and out["attention_mask"].dtype == torch.bool
    assert out["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert out["attention_mask"].tolist() == [[True, True, True], [False, False, True]]
    assert out["prompt_length"].tolist() == [3, 1]
    assert out["prompts"] == ["a", "b"]
    assert out["extras"] == {"answer": ["1", None], "id": [None, 4]}


def test_collate_pad_equal_to_a_real_token():
    out = collate_prompts([{"input_ids": [1, 1], "prompt": ""}, {"input_ids": [1], "prompt": ""}], pad_token_id=1)
    assert out["attention_mask"].tolist() == [[True, True], [False, True]]  # the mask comes from lengths


@pytest.mark.parametrize("items, pad, message", [
    ([], 0, "collate_prompts: items is empty"),
    ([{"input_ids": [1], "prompt": ""}], None, "pad_token_id: expected an int, got None"),
    ([{"input_ids": [1], "prompt": ""}, {"input_ids": [], "prompt": ""}], 0, "item 1 has no input_ids"),
])
def test_collate_errors(items, pad, message):
    with pytest.raises(ValueError, match=message):
        collate_prompts(items, pad)
