"""RewardModel: neural scorer at the last real token (hand-built scorer and a real HF classifier), micro-batches,
reward functions (thread pool over chunks), composition, boundary checks naming function and sample."""
import numpy as np
import pytest
import torch

from verl_ds.models import RewardFunctionError, RewardModel

from models_testutil import EOS, PAD, VOCAB, TokenScorer


def texts(batch):
    n = len(batch)
    return [f"p{i}" for i in range(n)], [f"r{i}" for i in range(n)]


def per_token_scores_reference(scorer, ids):
    """Score of an unpadded single sequence at its last token, computed from the backbone + head."""
    with torch.no_grad():
        h = scorer.model(input_ids=ids).last_hidden_state
        return scorer.score(h)[:, -1, 0]


def test_neural_scorer_scores_last_real_token(tiny_scorer, make_rollout):
    b = make_rollout()
    rm = RewardModel(model=tiny_scorer)
    scores = rm.get_reward(b.observation, b.mask)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    for i in range(4):
        real = b.observation[i][b.mask[i]].unsqueeze(0)
        torch.testing.assert_close(scores[i], per_token_scores_reference(tiny_scorer, real)[0], atol=1e-5, rtol=0)


def test_neural_scorer_with_pad_equal_to_eos(tiny_scorer):
    # pad == eos: HF's own pooling (input_ids != pad) would score the token before the final EOS
    tiny_scorer.config.pad_token_id = EOS
    rm = RewardModel(model=tiny_scorer)
    obs = torch.tensor([[EOS, 5, 6, 7, EOS], [4, 5, 6, 7, 8]])
    mask = torch.tensor([[0, 1, 1, 1, 1], [1, 1, 1, 1, 1]]).bool()
    scores = rm.get_reward(obs, mask)
    torch.testing.assert_close(scores[0], per_token_scores_reference(tiny_scorer, obs[:1, 1:])[0], atol=1e-5, rtol=0)
    with torch.no_grad():
        hf_pooled = tiny_scorer(input_ids=obs, attention_mask=mask.long()).logits[0, 0]
    assert not torch.isclose(scores[0], hf_pooled)


def test_get_reward_from_threads_is_consistent(tiny_scorer, make_rollout):
    import threading

    b = make_rollout()
    rm = RewardModel(model=tiny_scorer)
    want = rm.get_reward(b.observation, b.mask)
    got = [None] * 6
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, rm.get_reward(b.observation, b.mask)))
               for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in got:
        torch.testing.assert_close(g, want)


@pytest.mark.parametrize("padding", ["left", "right", "rollout"])
def test_last_token_scorer_matches_a_loop_over_rows(tiny_scorer, padding):
    """The scorer the RL reward and the RM loss share: a loop's last attended column of each row, any padding side."""
    from verl_ds.models.reward import LastTokenScorer

    B, T, lengths = 5, 7, [7, 1, 4, 6, 3]
    ids = torch.randint(3, VOCAB, (B, T), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        start = {"left": T - n, "right": 0, "rollout": (T - n) // 2}[padding]  # rollout: left prompt, right response
        mask[i, start:start + n] = True
    last = [max(j for j in range(T) if mask[i, j]) for i in range(B)]
    table = TokenScorer({t: float(t) for t in range(VOCAB)})
    hand = LastTokenScorer(table)(ids, mask, "test")
    assert hand.tolist() == [float(ids[i, last[i]]) for i in range(B)]
    scorer = LastTokenScorer(tiny_scorer)
    got = scorer(ids, mask, "test")
    assert got.requires_grad  # the RM job trains through it
    scorer.close()
    assert not tiny_scorer.score._forward_hooks
    for i in range(B):  # each row alone, unpadded: the score at its last token
        want = per_token_scores_reference(tiny_scorer, ids[i, last[i] + 1 - lengths[i]:last[i] + 1].unsqueeze(0))
        torch.testing.assert_close(got[i].detach(), want[0], atol=1e-5, rtol=0)


def test_batch_mode_scores_on_last_response_token_and_weighted_sum(make_rollout):
    b = make_rollout()
    rm = RewardModel()
    rm.register_reward_fn(lambda p, r, batch: [1.0, 2.0, 3.0, 4.0], name="a", weight=0.5)
    rm.register_reward_fn(lambda p, r, batch: torch.tensor([10.0, 0.0, 0.0, 0.0], dtype=torch.float64), name="b")
    scores, metrics = rm.compute_rewards(b, *texts(b))
    assert scores.dtype == torch.float32 and scores.shape == (4, 4)
    want = torch.zeros(4, 4)
    last = b.response_length - 1
    want[torch.arange(4), last] = torch.tensor([0.5 + 10.0, 1.0, 1.5, 2.0])
    torch.testing.assert_close(scores, want)
    assert {k: float(v) for k, v in metrics.items()} == {"reward/a/mean": 2.5, "reward/b/mean": 2.5}
    assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in metrics.values())  # no host sync here


def test_scorer_and_functions_compose(tiny_scorer, make_rollout):
    b = make_rollout()
    rm = RewardModel(model=tiny_scorer, model_weight=2.0, model_name="rm")
    rm.register_reward_fn(lambda p, r, batch: [1.0] * 4, name="bonus")
    scores, metrics = rm.compute_rewards(b, *texts(b))
    neural = rm.get_reward(b.observation, b.mask)
    torch.testing.assert_close(scores.sum(-1), 2.0 * neural + 1.0)
    assert set(metrics) == {"reward/rm/mean", "reward/bonus/mean"}
    assert float(metrics["reward/rm/mean"]) == pytest.approx(float(neural.mean()), abs=1e-6)


def test_per_token_padding_zeroed_and_eos_modes(make_rollout):
    b = make_rollout()  # row 0 ends with EOS at column 2 (length 3); others truncated (length 4)
    assert b.done.tolist() == [True, False, False, False] and b.response_length.tolist() == [3, 4, 4, 4]
    ones = lambda p, r, batch: torch.ones(4, 4, dtype=torch.float64)  # noqa: E731
    zero = RewardModel(eos_reward="zero")
    zero.register_reward_fn(ones, name="t", per_token=True)
    s, m = zero.compute_rewards(b, *texts(b))
    assert s[0].tolist() == [1.0, 1.0, 0.0, 0.0]  # EOS zeroed, padding zeroed
    assert s[1].tolist() == [1.0, 1.0, 1.0, 1.0]  # truncated: no EOS to zero
    keep = RewardModel(eos_reward="keep")
    keep.register_reward_fn(ones, name="t", per_token=True)
    s, _ = keep.compute_rewards(b, *texts(b))
    assert s[0].tolist() == [1.0, 1.0, 1.0, 0.0]
    ragged = RewardModel(eos_reward="keep")
    ragged.register_reward_fn(lambda p, r, batch: [[0.5] * int(n) for n in batch.response_length], name="rag",
                              per_token=True)
    s, m = ragged.compute_rewards(b, *texts(b))
    torch.testing.assert_close(s, 0.5 * b.response_mask.float())
    assert float(m["reward/rag/mean"]) == pytest.approx(0.5 * 15 / 4)
    with pytest.raises(ValueError, match="eos_reward must be one of"):
        RewardModel(eos_reward="drop")


def test_numpy_and_int_outputs_converted(make_rollout):
    b = make_rollout()
    rm = RewardModel()
    rm.register_reward_fn(lambda p, r, batch: np.array([1, 0, 1, 0]), name="np_int")
    scores, _ = rm.compute_rewards(b, *texts(b))
    assert scores.dtype == torch.float32 and scores.sum().item() == 2.0


@pytest.mark.parametrize("out, message", [
    ([1.0, 2.0, 3.0], r"reward function 'bad': returned 3 values for 4 samples"),
    ([1.0, float("nan"), 0.0, 0.0], r"reward function 'bad' \(sample 1\): returned a non-finite reward \(nan\)"),
    ([1.0, 2.0, "x", 0.0], r"reward function 'bad' \(sample 2\): returned str 'x'; expected a float"),
    (torch.zeros(4, 1), r"returned shape \(B, 1\) = \(4, 1\); return \(B,\) \(squeeze the last dim\)"),
    (torch.zeros(4, 4), r"returned shape \(4, 4\); expected \(4,\), one value per sample"),
    (None, r"returned NoneType; expected a list of 4 floats"),
    (torch.tensor([1j, 0, 0, 0]), r"dtype torch.complex64; expected real numbers"),
])
def test_bad_outputs_name_function_and_sample(make_rollout, out, message):
    b = make_rollout()
    rm = RewardModel()
    rm.register_reward_fn(lambda p, r, batch: out, name="bad")
    with pytest.raises(RewardFunctionError, match=message):
        rm.compute_rewards(b, *texts(b))


def test_per_token_bad_outputs(make_rollout):
    b = make_rollout()
    rm = RewardModel()
    rm.register_reward_fn(lambda p, r, batch: torch.zeros(4, 3), name="pt", per_token=True)
    with pytest.raises(RewardFunctionError, match=r"'pt': per-token reward returned shape \(4, 3\); expected \(B, R\)"):
        rm.compute_rewards(b, *texts(b))
    rm.register_reward_fn(lambda p, r, batch: [[1.0]] * 4, name="pt", per_token=True)
    with pytest.raises(RewardFunctionError, match=r"'pt' \(sample 0\): per-token row has 1 values; expected "
                                                  r"response_length=3 or R=4"):
        rm.compute_rewards(b, *texts(b))
    inf_in_padding = torch.zeros(4, 4)
    inf_in_padding[0, 3] = float("inf")  # beyond row 0's response: ignored
    rm.register_reward_fn(lambda p, r, batch: inf_in_padding, name="pt", per_token=True)
    rm.compute_rewards(b, *texts(b))


def test_exception_names_function_and_failing_sample(make_rollout):
    b = make_rollout()

    def picky(prompts, responses, batch):
        return [1.0 / (0 if r == "r2" else 1) for r in responses]

    rm = RewardModel()
    rm.register_reward_fn(picky)
    with pytest.raises(RewardFunctionError,
                       match=r"reward function 'picky' \(sample 2\): raised ZeroDivisionError") as e:
        rm.compute_rewards(b, *texts(b))
    assert e.value.index == 2 and e.value.name == "picky" and isinstance(e.value.__cause__, ZeroDivisionError)


def test_systemexit_from_a_reward_function_is_a_reward_error_not_the_end_of_the_process(make_rollout):
    """Issue 31 item 10: sys.exit() inside a function used to end the rank on its own (no log, no audit); now every
    rank fails the step together (StepFailed) with the function and the sample named."""
    b = make_rollout()

    def quits(prompts, responses, batch):
        if "r1" in responses:
            raise SystemExit(3)
        return [0.0] * len(responses)

    rm = RewardModel()
    rm.register_reward_fn(quits)
    with pytest.raises(RewardFunctionError, match=r"reward function 'quits' \(sample 1\): raised SystemExit: 3"):
        rm.compute_rewards(b, *texts(b))


def test_registration_rules_and_hot_replace(make_rollout):
    b = make_rollout()
    rm = RewardModel()
    with pytest.raises(ValueError, match="no reward source"):
        rm.compute_rewards(b, *texts(b))
    with pytest.raises(ValueError, match=r"weight must be a finite float in \[-1e\+06, 1e\+06\], got inf"):
        rm.register_reward_fn(lambda p, r, x: [0.0] * 4, weight=float("inf"))
    with pytest.raises(ValueError, match=r"weight must be a finite float in \[-1e\+06, 1e\+06\], got 1e\+39"):
        rm.register_reward_fn(lambda p, r, x: [0.0] * 4, weight=1e39)  # finite in float64, inf in float32
    with pytest.raises(TypeError, match="fn must be callable"):
        rm.register_reward_fn("nope")
    assert rm.register_reward_fn(lambda p, r, x: [0.0] * 4) == "lambda_0"
    rm.register_reward_fn(lambda p, r, x: [1.0] * 4, name="lambda_0", weight=2.0)  # replaces, same slot
    assert rm.reward_fns() == [{"name": "lambda_0", "weight": 2.0, "per_token": False}]
    scores, _ = rm.compute_rewards(b, *texts(b))
    assert scores.sum().item() == 8.0
    with pytest.raises(ValueError, match="got 3 prompts and 4 responses"):
        rm.compute_rewards(b, ["a"] * 3, ["b"] * 4)
    rm.unregister_reward_fn("lambda_0")
    with pytest.raises(KeyError, match="no reward function named 'lambda_0'"):
        rm.unregister_reward_fn("lambda_0")


def test_state_dict_and_roles(make_rollout):
    rm = RewardModel(eos_reward="keep", model_weight=0.5, micro_batch_size=8, num_workers=3)
    rm.register_reward_fn(lambda p, r, x: [0.0], name="f", weight=3.0)
    sd = rm.state_dict()
    assert sd == {"eos_reward": "keep", "model_weight": 0.5, "model_name": "reward_model", "micro_batch_size": 8,
                  "num_workers": 3, "reward_fns": [{"name": "f", "weight": 3.0, "per_token": False}]}
    other = RewardModel()
    other.register_reward_fn(lambda p, r, x: [0.0], name="f")
    other.load_state_dict(sd)
    assert other.eos_reward == "keep" and other.reward_fns()[0]["weight"] == 3.0
    assert other.micro_batch_size == 8 and other.num_workers == 3
    with pytest.raises(ValueError, match="has no neural scorer"):
        rm.get_reward(torch.ones(1, 2, dtype=torch.long))
    for name in ("get_value", "get_action", "get_logprob", "update"):  # scores only; no optimizer any more
        assert not hasattr(rm, name), name


def test_more_reward_messages(make_rollout, tiny_scorer):
    from models_testutil import tiny_llama_config
    from transformers import LlamaForSequenceClassification

    b = make_rollout()
    with pytest.raises(TypeError, match="model must be a sequence-classification nn.Module"):
        RewardModel(model=3)
    rm = RewardModel()
    with pytest.raises(TypeError, match="per_token must be a bool, got 1"):
        rm.register_reward_fn(lambda p, r, x: [0.0] * 4, per_token=1)
    with pytest.raises(ValueError, match="name must be a non-empty str other than the scorer's 'reward_model'"):
        rm.register_reward_fn(lambda p, r, x: [0.0] * 4, name="reward_model")
    two = LlamaForSequenceClassification(tiny_llama_config(num_labels=2)).eval()
    with pytest.raises(ValueError, match="the scorer has 2 labels; a reward model needs num_labels=1"):
        RewardModel(model=two).get_reward(b.observation, b.mask)
    rm.register_reward_fn(lambda p, r, x: torch.ones(4, 4), name="pt", per_token=True)
    no_done = b.clone()
    no_done.done = None
    with pytest.raises(ValueError, match=r"per-token reward 'pt' with eos_reward='zero' needs batch.done"):
        rm.compute_rewards(no_done, *texts(b))
    no_len = b.clone()
    no_len.response_length = None
    with pytest.raises(ValueError, match="batch.response_length is required"):
        rm.compute_rewards(no_len, *texts(b))
    rm.register_reward_fn(lambda p, r, x: [[1.0] * 4] * 3, name="pt", per_token=True)
    with pytest.raises(RewardFunctionError, match=r"per-token reward returned 3 rows; expected B=4 rows"):
        rm.compute_rewards(b, *texts(b))
    with pytest.raises(ValueError, match="eos_reward must be one of"):
        rm.load_state_dict({"eos_reward": "sometimes"})
    too_long = b.clone()
    too_long.response_length[1] = 5
    with pytest.raises(ValueError, match=r"batch.response_length\[1\] = 5 is outside \[1, R=4\]"):
        rm.compute_rewards(too_long, *texts(b))
    for key, value in (("micro_batch_size", 0), ("num_workers", True), ("num_workers", 1.5)):
        with pytest.raises(ValueError, match=f"RewardModel: {key} must be an int >= 1, got {value!r}"):
            RewardModel(**{key: value})


# ---- a hand-built scorer: micro-batches ----------------------------------------------------------------------------

def test_hand_scorer_at_last_real_token_in_micro_batches():
    scorer = TokenScorer({3: 0.5, 4: -1.0, 5: 2.0, 6: 4.0, EOS: 8.0})
    rm = RewardModel(model=scorer, micro_batch_size=2)
    obs = torch.tensor([[PAD, 3, 4, EOS], [3, 4, 5, PAD], [PAD, PAD, 6, 6], [3, 3, 3, 3], [PAD, 5, 4, PAD]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0], [0, 0, 1, 1], [1, 1, 1, 1], [0, 1, 1, 0]]).bool()
    assert rm.get_reward(obs, mask).tolist() == [8.0, 2.0, 4.0, 0.5, -1.0]
    assert scorer.batch_sizes == [2, 2, 1]
    scorer.batch_sizes.clear()
    assert RewardModel(model=scorer).get_reward(obs, mask).tolist() == [8.0, 2.0, 4.0, 0.5, -1.0]
    assert scorer.batch_sizes == [5]


# ---- reward functions on a thread pool -----------------------------------------------------------------------------

def test_num_workers_chunks_joined_in_order(make_rollout):
    b = make_rollout(B=5)
    seen = []

    def by_text(prompts, responses, batch):
        seen.append((list(responses), len(batch)))
        return [float(r[1:]) * 10 for r in responses]  # "r3" -> 30.0

    rm = RewardModel(num_workers=2)
    rm.register_reward_fn(by_text)
    scores, metrics = rm.compute_rewards(b, *texts(b))
    assert scores.sum(-1).tolist() == [0.0, 10.0, 20.0, 30.0, 40.0]
    assert sorted(seen) == [(["r0", "r1"], 2), (["r2", "r3", "r4"], 3)]  # contiguous chunks, batch sliced with them
    assert float(metrics["reward/by_text/mean"]) == 20.0
    per_token = RewardModel(num_workers=3, eos_reward="keep")
    per_token.register_reward_fn(lambda p, r, batch: torch.full((len(r), 4), float(len(r))), name="n", per_token=True)
    tok, _ = per_token.compute_rewards(b, *texts(b))
    # chunks of 1, 2, 2 rows (5 * k // 3), each row scored with its chunk's size, zero past its length
    want = torch.tensor([1.0, 2.0, 2.0, 2.0, 2.0])[:, None] * b.response_mask.float()
    torch.testing.assert_close(tok, want)


def test_num_workers_errors_name_the_global_sample(make_rollout):
    b = make_rollout(B=6)

    def picky(prompts, responses, batch):
        return [1.0 / (0 if r == "r4" else 1) for r in responses]

    rm = RewardModel(num_workers=3)
    rm.register_reward_fn(picky)
    with pytest.raises(RewardFunctionError, match=r"reward function 'picky' \(sample 4\): raised ZeroDivisionError"):
        rm.compute_rewards(b, *texts(b))

    def nan_at_5(prompts, responses, batch):
        return [float("nan") if r == "r5" else 0.0 for r in responses]

    rm.register_reward_fn(nan_at_5, name="picky")
    with pytest.raises(RewardFunctionError, match=r"'picky' \(sample 5\): returned a non-finite reward \(nan\)"):
        rm.compute_rewards(b, *texts(b))
    rm.register_reward_fn(lambda p, r, batch: [0.0], name="picky")
    with pytest.raises(RewardFunctionError, match=r"'picky': returned 1 value\(s\) for a chunk of 2 samples "
                                                  r"\(rows 0\.\.1\); expected one per sample"):
        rm.compute_rewards(b, *texts(b))
