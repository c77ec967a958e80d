"""RolloutBatch: layout, field names and the design's aliases, coerce, validation messages, split/select/cat/to."""
import pytest
import torch

from verl_ds.batch import DESIGN_FIELDS, FIELDS, REQUIRED_FOR_LOSS, BatchValidationError, RolloutBatch

PAD, EOS = 0, 2


def make_batch(B=4, P=3, R=4, full=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(1, P + 1, (B,), generator=g)
    prompt_mask = torch.arange(P).unsqueeze(0) >= (P - prompt_len).unsqueeze(1)
    prompt_ids = torch.where(prompt_mask, torch.randint(3, 20, (B, P), generator=g), torch.full((B, P), PAD))
    responses = torch.randint(3, 20, (B, R), generator=g)
    responses[0, 1] = EOS  # row 0 ends with EOS after 2 tokens; others are truncated at R
    b = RolloutBatch.from_generation(prompt_ids, prompt_mask, responses, pad_token_id=PAD, eos_token_id=EOS,
                                     extras={"prompt": [f"p{i}" for i in range(B)], "answer": list(range(B))})
    if full:
        for f in ("old_log_probs", "ref_log_probs", "values", "token_rewards", "scores", "advantages", "returns",
                  "rollout_log_probs"):
            b[f] = torch.randn(B, R, generator=g) * b.response_mask
        b.group_index = torch.arange(B) // 2
    return b


def test_from_generation_layout():
    b = make_batch()
    assert b.response_length.tolist() == [2, 4, 4, 4]
    assert b.done.tolist() == [True, False, False, False]
    assert b.response_mask.dtype == torch.bool and b.mask.dtype == torch.bool
    assert b.observation.shape == (4, 7) and b.action.shape == (4, 4)
    assert torch.equal(b.action, b.observation[:, 3:])
    assert b.action[0, 2:].tolist() == [PAD, PAD]  # past the EOS: pad
    assert torch.equal(b.next_observation[:, :-1], b.observation[:, 1:])
    assert (b.next_observation[:, -1] == PAD).all()
    assert b.prompt_width == 3 and b.response_width == 4 and len(b) == 4
    b.validate(PAD)


def test_pad_equals_eos_uses_response_length_not_token_ids():
    # pad == eos: the EOS token is real (mask True) even though it equals the pad id
    prompt_ids = torch.tensor([[PAD, 5, 6], [4, 5, 6]])
    prompt_mask = prompt_ids != PAD
    responses = torch.tensor([[7, PAD, PAD], [8, 9, 10]])
    b = RolloutBatch.from_generation(prompt_ids, prompt_mask, responses, torch.tensor([2, 3]),
                                     pad_token_id=PAD, eos_token_id=PAD)
    assert b.response_mask.tolist() == [[True, True, False], [True, True, True]]
    assert b.done.tolist() == [True, False]
    b.validate(PAD, required=("observation", "mask", "response_mask"))


def test_response_length_from_eos():
    ids = torch.tensor([[5, 2, 2], [5, 6, 7], [2, 0, 0]])
    assert RolloutBatch.response_length_from_eos(ids, 2).tolist() == [2, 3, 1]


FIELD_ALIASES = {"logprob": "old_log_probs", "ref_logprob": "ref_log_probs", "value": "values", "old_value": "values",
                 "score": "scores", "reward": "token_rewards", "advantage": "advantages", "return": "returns"}


def test_design_names_are_aliases():
    b = make_batch()
    for alias, field in FIELD_ALIASES.items():
        assert b[alias] is b[field] is getattr(b, alias) is getattr(b, field), alias
        assert alias in b and field in b
    new = torch.zeros(4, 4)
    b.reward = new  # writing through an alias writes the field
    assert b.token_rewards is new and b["reward"] is new
    b["old_value"] = None
    assert "values" not in b and "value" not in b and b.values is None
    assert set(b.present()) <= set(FIELDS) and "values" not in b.present()


def test_contains_means_set():
    b = make_batch(full=False)
    assert "observation" in b and "done" in b
    assert "old_log_probs" not in b and "logprob" not in b  # a field not set yet
    assert "bogus" not in b and 3 not in b  # not a field at all: no error, just absent


def test_attribute_errors_suggest():
    b = make_batch()
    with pytest.raises(AttributeError, match=r"no field 'logprobs'; did you mean 'logprob'.*'old_log_probs'"):
        b.logprobs
    with pytest.raises(TypeError, match=r"RolloutBatch.values must be a torch.Tensor or None, got list"):
        b.value = [1.0]


def test_coerce_from_a_mapping():
    b = make_batch()
    same = RolloutBatch.coerce(b)
    assert same is b
    plain = {"observation": b.observation, "action": b.action, "mask": b.mask, "logprob": b.old_log_probs,
             "advantages": b.advantages, "values": None, "extras": {"prompt": b.extras["prompt"]}}
    c = RolloutBatch.coerce(plain)
    assert isinstance(c, RolloutBatch) and c.old_log_probs is b.old_log_probs
    assert c.extras["prompt"] == b.extras["prompt"]
    assert "values" not in c and len(c) == 4
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.advantagez: batch has unknown field\(s\) "
                                                   r"\['advantagez'\]; did you mean .*'advantages'"):
        RolloutBatch.coerce({"observation": b.observation, "advantagez": b.advantages})
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.old_log_probs: batch\['logprob'\] must be a "
                                                   r"torch.Tensor, got list"):
        RolloutBatch.coerce({"logprob": [0.0]})
    with pytest.raises(TypeError, match=r"ppo batch must be a RolloutBatch or a mapping of field name -> tensor "
                                        r"\(e.g. \{'observation': ..., 'mask': ...\}\), got list"):
        RolloutBatch.coerce([b.observation], who="ppo batch")


def test_missing_required_field_is_named():
    b = make_batch(full=False)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.old_log_probs: missing: expected a \(B, R\) "
                                                   r"float32 tensor, found None"):
        b.validate(PAD)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.advantages: missing"):
        b.validate(PAD, required=("observation", "advantage"))  # aliases name the field
    assert set(DESIGN_FIELDS) <= set(REQUIRED_FOR_LOSS)


def test_float64_logprob_rejected():
    b = make_batch()
    b.logprob = b.logprob.double()
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.old_log_probs: expected dtype float32, found "
                                                   r"float64"):
        b.validate(PAD)


def test_group_index_checked():
    b = make_batch()
    b.validate(PAD)
    b.group_index = torch.zeros(4)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.group_index: expected dtype int64, found float32"):
        b.validate(PAD)
    b.group_index = torch.zeros(3, dtype=torch.long)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.group_index: expected B = 4"):
        b.validate(PAD)


def test_int_mask_rejected():
    b = make_batch()
    b.mask = b.mask.long()
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.mask: expected dtype bool, found int64 "
                                                   r"\(use a bool mask"):
        b.validate(PAD)


def test_shape_mismatch_named():
    b = make_batch()
    b.value = torch.zeros(4, 5)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.values: expected R = 4 \(from action\), found "
                                                   r"shape \(4, 5\)"):
        b.validate(PAD)
    b = make_batch()
    b.done = torch.zeros(3, dtype=torch.bool)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.done: expected B = 4"):
        b.validate(PAD)
    b = make_batch()
    b.value = torch.zeros(4)
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.values: expected 2-D \(B, R\), found shape "
                                                   r"\(4,\)"):
        b.validate(PAD)


def test_non_finite_named_with_index():
    b = make_batch()
    b.advantage[2, 1] = float("nan")
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.advantages: expected finite float32 values, found "
                                                   r"nan at index \(2, 1\)"):
        b.validate(PAD)


def test_wrong_padding_value():
    b = make_batch()
    row = int((~b.mask[:, :3]).any(-1).nonzero()[0])
    col = int((~b.mask[row]).nonzero()[0])
    b.observation[row, col] = 7
    with pytest.raises(BatchValidationError, match=rf"RolloutBatch.observation: expected pad_token_id 0 wherever "
                                                   rf"mask is False, found 7 at \({row}, {col}\)"):
        b.validate(PAD)
    with pytest.raises(BatchValidationError, match="pad_token_id 5"):
        make_batch().validate(5)


def test_mask_inconsistent_with_lengths():
    b = make_batch()
    b.response_mask = b.response_mask.clone()
    b.response_mask[0, 3] = True  # row 0 has length 2
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.response_mask: expected False past the first "
                                                   r"response_length columns.*\(0, 3\)"):
        b.validate(PAD)
    b = make_batch()
    b.response_length = b.response_length.clone()
    b.response_length[1] = 0
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.response_length: expected values in \[1, R=4\], "
                                                   r"found 0 at row 1"):
        b.validate(PAD)


def test_action_must_match_observation():
    b = make_batch()
    b.action = b.action.clone()
    b.action[1, 0] += 1
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.action: expected action == observation\[:, P:\]"):
        b.validate(PAD)


def test_extras_length_checked():
    b = make_batch()
    b.extras["answer"] = [1, 2]
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.extras\['answer'\]: expected a per-sample sequence "
                                                   r"of length B = 4, found list of length 2"):
        b.validate(PAD)


def test_validate_pad_id_type():
    with pytest.raises(TypeError, match="pad_token_id must be an int, got None"):
        make_batch().validate(None)


def test_select_and_split_slice_extras():
    b = make_batch(B=6)
    s = b.select([4, 1])
    assert s.extras["prompt"] == ["p4", "p1"] and s.extras["answer"] == [4, 1]
    assert torch.equal(s.observation, b.observation[[4, 1]])
    parts = b.split(2, generator=torch.Generator().manual_seed(0))
    assert len(parts) == 3 and all(len(p) == 2 for p in parts)
    seen = sorted(x for p in parts for x in p.extras["answer"])
    assert seen == list(range(6))
    again = b.split(2, generator=torch.Generator().manual_seed(0))
    assert [p.extras["answer"] for p in parts] == [p.extras["answer"] for p in again]
    for p in parts:  # rows stay aligned across fields and extras
        for i, a in enumerate(p.extras["answer"]):
            assert torch.equal(p.observation[i], b.observation[a])
            assert p.extras["prompt"][i] == f"p{a}"
    ordered = b.split(3, shuffle=False)
    assert ordered[0].extras["answer"] == [0, 1, 2]
    with pytest.raises(ValueError, match="batch size 6 is not divisible by mini_batch_size 4"):
        b.split(4)
    b.group_index = torch.tensor([7, 3, 7, 3, 9, 9])  # groups of two, interleaved: shuffled as units
    for seed in range(5):
        for size, per in ((2, 1), (6, 3)):
            parts = b.split(size, generator=torch.Generator().manual_seed(seed))
            for p in parts:  # whole groups, each group's rows adjacent and in batch order
                g = p.group_index.tolist()
                assert [g[i] for i in range(0, size, 2)] == [g[i] for i in range(1, size, 2)]
                assert len(set(g)) == per and all(a < c for a, c in zip(p.extras["answer"][::2],
                                                                         p.extras["answer"][1::2]))
            assert sorted(x for p in parts for x in p.extras["answer"]) == list(range(6))
    orders = {tuple(x for p in b.split(2, generator=torch.Generator().manual_seed(s)) for x in p.extras["answer"])
              for s in range(20)}
    assert len(orders) == 6  # every order of the three groups occurs
    b.group_index = torch.arange(6)  # one sample per group: the plain row shuffle
    rows = torch.randperm(6, generator=torch.Generator().manual_seed(0)).tolist()
    assert [p.extras["answer"] for p in b.split(2, generator=torch.Generator().manual_seed(0))] == \
        [rows[0:2], rows[2:4], rows[4:6]]
    with pytest.raises(IndexError, match=r"indices must be in \[0, 6\)"):
        b.select([6])


def test_cat_roundtrip_and_errors():
    b = make_batch(B=6)
    parts = b.split(2, shuffle=False)
    c = RolloutBatch.cat(parts)
    for f, t in b.items():
        assert torch.equal(c[f], t), f
    assert c.extras == {k: list(v) for k, v in b.extras.items()}
    other = make_batch(B=2, P=5)
    with pytest.raises(ValueError, match=r"field 'observation' of batch 1 has shape \(2, 9\), batch 0 has \(2, 7\)"):
        RolloutBatch.cat([parts[0], other])
    missing = parts[1].select([0, 1])
    missing.value = None
    with pytest.raises(ValueError, match=r"batch 1 sets fields .* \(differ in \['values'\]\)"):
        RolloutBatch.cat([parts[0], missing])
    with pytest.raises(ValueError, match="empty list"):
        RolloutBatch.cat([])


def test_to_device_and_clone():
    b = make_batch()
    c = b.to("cpu")
    assert c is not b and torch.equal(c.observation, b.observation) and c.extras["prompt"] == b.extras["prompt"]
    d = b.clone()
    d.value[0, 0] = 123.0
    assert b.value[0, 0] != 123.0


def test_more_batch_messages():
    b = make_batch()
    with pytest.raises(TypeError, match="RolloutBatch.extras must be a dict, got list"):
        b.extras = []
    with pytest.raises(KeyError, match="no field 'bogus'"):
        b["bogus"]
    with pytest.raises(BatchValidationError, match="the batch is empty: no field is set"):
        RolloutBatch().validate(PAD, required=())
    with pytest.raises(BatchValidationError, match="cannot tell the response width R"):
        RolloutBatch(observation=b.observation).response_width
    wide = RolloutBatch(observation=b.observation, action=torch.zeros(4, 7, dtype=torch.long))
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.action: expected response width R < T = 7"):
        wide.validate(PAD, required=())
    bad = make_batch()
    bad.prompt_length = bad.prompt_length.clone()
    bad.prompt_length[3] = 9
    with pytest.raises(BatchValidationError, match=r"RolloutBatch.prompt_length: expected values in \[1, P=3\], "
                                                   r"found 9 at row 3"):
        bad.validate(PAD)
    right_padded = make_batch()
    right_padded.prompt_length = torch.full((4,), 3)
    if not torch.equal(right_padded.prompt_length, b.prompt_length):
        with pytest.raises(BatchValidationError, match=r"RolloutBatch.mask: expected the prompt part True on the "
                                                       r"last prompt_length columns \(left padding\)"):
            right_padded.validate(PAD)
    with pytest.raises(ValueError, match="mini_batch_size must be an int >= 1, got 0"):
        b.split(0)
    with pytest.raises(ValueError, match="pass response_length or eos_token_id"):
        RolloutBatch.from_generation(torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2), torch.ones(1, 2,
                                     dtype=torch.long), pad_token_id=PAD)
    with pytest.raises(ValueError, match=r"from_generation: shapes disagree: prompt_ids \(2, 2\)"):
        RolloutBatch.from_generation(torch.ones(2, 2, dtype=torch.long), torch.ones(2, 2),
                                     torch.ones(3, 2, dtype=torch.long), torch.ones(3, dtype=torch.long),
                                     pad_token_id=PAD)
    assert "observation=(4, 7):int64" in repr(b)
