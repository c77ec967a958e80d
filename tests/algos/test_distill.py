"""On-policy distillation's per-token term (``algos.distill.reverse_kl_term``) against a float64 loop and a
hand-computed case (masked tokens, T=1, fully masked rows, bf16, non-finite values on masked tokens), its bad inputs,
and where PPOModel.compute_advantage puts it: added to the advantages or to the token rewards, never on an agent
row's tool tokens."""
import math

import pytest
import torch

from verl_ds.algos.distill import reverse_kl_term
from ppo_testutil import batch_of, make_ppo


def loop_reference(student, teacher, mask, coef):
    """The term and the two metrics, one token at a time in float64."""
    B, R = len(student), len(student[0])
    term = [[0.0] * R for _ in range(B)]
    kl_sum = t_sum = n = 0.0
    for b in range(B):
        for r in range(R):
            if mask[b][r]:
                d = float(student[b][r]) - float(teacher[b][r])
                term[b][r] = -coef * d
                kl_sum, t_sum, n = kl_sum + d, t_sum + float(teacher[b][r]), n + 1
    return torch.tensor(term, dtype=torch.float64), (kl_sum / n if n else 0.0), (t_sum / n if n else 0.0)


@pytest.mark.parametrize("shape", [(5, 7), (3, 1), (1, 1)])  # T=1 rows too
@pytest.mark.parametrize("coef", [1.0, 0.3])
def test_matches_a_float64_loop(shape, coef):
    g = torch.Generator().manual_seed(shape[0] * 10 + shape[1])
    student = -torch.rand(shape, generator=g, dtype=torch.float64) * 5
    teacher = -torch.rand(shape, generator=g, dtype=torch.float64) * 5
    mask = torch.rand(shape, generator=g) < 0.7
    mask[0] = True  # at least one token counts
    if shape[0] > 2:
        mask[1] = False  # a fully masked row
    term, m = reverse_kl_term(student, teacher, mask, coef)
    want, kl, tlp = loop_reference(student.tolist(), teacher.tolist(), mask.tolist(), coef)
    assert term.dtype == torch.float32 and term.shape == shape
    torch.testing.assert_close(term.double(), want, atol=1e-6, rtol=1e-6)
    assert math.isclose(float(m["distill/reverse_kl"]), kl, abs_tol=1e-6)
    assert math.isclose(float(m["distill/teacher_logprob"]), tlp, abs_tol=1e-6)
    if shape[0] > 2:
        assert not term[1].any()


def test_hand_computed_case():
    student = torch.tensor([[-1.0, -2.0, -0.5]])
    teacher = torch.tensor([[-1.5, -1.0, -3.0]])
    mask = torch.tensor([[True, True, False]])
    term, m = reverse_kl_term(student, teacher, mask, coef=2.0)
    # 2 * (teacher - student) on the two written tokens: 2 * (-0.5), 2 * 1.0; the third is masked
    assert term.tolist() == [[-1.0, 2.0, 0.0]]
    assert float(m["distill/reverse_kl"]) == pytest.approx((0.5 + -1.0) / 2)
    assert float(m["distill/teacher_logprob"]) == pytest.approx((-1.5 + -1.0) / 2)


def test_all_masked_gives_zeros_and_finite_metrics_even_over_non_finite_values():
    student = torch.tensor([[-1.0, float("nan")], [-2.0, 0.0]])
    teacher = torch.tensor([[float("-inf"), -1.0], [float("nan"), -3.0]])
    term, m = reverse_kl_term(student, teacher, torch.zeros(2, 2, dtype=torch.bool))
    assert torch.equal(term, torch.zeros(2, 2)) and float(m["distill/reverse_kl"]) == 0.0
    assert float(m["distill/teacher_logprob"]) == 0.0
    mask = torch.tensor([[False, False], [False, True]])  # the one counted token is finite: nothing else leaks in
    term, m = reverse_kl_term(student, teacher, mask)
    assert torch.isfinite(term).all() and term.tolist() == [[0.0, 0.0], [0.0, -3.0]]
    assert float(m["distill/reverse_kl"]) == 3.0


def test_bf16_inputs_give_float32_of_their_values():
    g = torch.Generator().manual_seed(3)
    student = (-torch.rand(4, 6, generator=g) * 4).bfloat16()
    teacher = (-torch.rand(4, 6, generator=g) * 4).bfloat16()
    mask = torch.ones(4, 6, dtype=torch.bool)
    term, m = reverse_kl_term(student, teacher, mask, 0.5)
    want, kl, _ = loop_reference(student.double().tolist(), teacher.double().tolist(), mask.tolist(), 0.5)
    assert term.dtype == torch.float32
    torch.testing.assert_close(term.double(), want, atol=1e-6, rtol=0)
    assert math.isclose(float(m["distill/reverse_kl"]), kl, abs_tol=1e-5)


def test_extreme_log_ratios_stay_exact():
    student, teacher = torch.tensor([[-1e-8, -60.0]]), torch.tensor([[-80.0, -1e-8]])
    term, _ = reverse_kl_term(student, teacher, torch.ones(1, 2, dtype=torch.bool))
    torch.testing.assert_close(term, torch.tensor([[-80.0, 60.0]]))


@pytest.mark.parametrize("args, error, words", [
    ((torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3)), ValueError, "shape mismatch"),
    ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4)), ValueError, "response_mask"),
    ((torch.zeros(2, 3), torch.zeros(2, 3), torch.full((2, 3), 0.5)), ValueError, "only 0 and 1"),
    ((torch.zeros(3), torch.zeros(3), torch.ones(3)), ValueError, "(B, R)"),
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3), torch.ones(2, 3)), TypeError, "log_probs"),
    ((torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), -1.0), ValueError, "coef"),
])
def test_bad_inputs_are_refused_by_name(args, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        reverse_kl_term(*args)


def _agent_like_batch():
    """Two rows whose responses hold a model turn, a tool answer (attended, masked out) and a model turn again."""
    b = batch_of([[4, 5, 6, 4], [6, 4, 5, 5]])
    b.response_mask = torch.tensor([[True, False, False, True], [True, True, False, True]])
    b.scores = torch.zeros(2, 4)
    return b


@pytest.mark.parametrize("mode", ["advantage", "reward"])
def test_compute_advantage_adds_the_term_on_model_tokens_only(mode):
    student = torch.tensor([[-1.0, -9.0, -9.0, -2.0], [-0.5, -1.5, -9.0, -1.0]])
    teacher = torch.tensor([[-3.0, 0.0, 0.0, -2.5], [-0.5, -1.0, 0.0, -4.0]])  # tool positions: anything
    b = _agent_like_batch()
    term, m = reverse_kl_term(student, teacher, b.response_mask)
    teacher_on_tools = teacher.clone()
    teacher_on_tools[~b.response_mask] = -50.0  # what the teacher says of tool tokens changes nothing
    term2, m2 = reverse_kl_term(student, teacher_on_tools, b.response_mask)
    assert torch.equal(term, term2) and m == m2
    ppo = make_ppo("reinforce_plus_plus", critic=False, ref=False, use_kl_penalty=False)
    ppo.compute_advantage(b, distill=(mode, term))
    adv = b.advantages
    assert not adv[~b.response_mask].any()
    if mode == "advantage":  # zero task reward: the estimator's advantages are 0, the term is the advantage
        assert torch.equal(adv, term)
    else:  # in the token rewards, before the estimator (REINFORCE++: discounted return to go, whitened)
        assert torch.equal(b.token_rewards, term)
        assert adv[b.response_mask].abs().sum() > 0


def test_compute_advantage_refuses_an_unknown_mode_and_is_unchanged_without_distill():
    ppo = make_ppo("reinforce_plus_plus", critic=False, ref=False, use_kl_penalty=False)
    with pytest.raises(ValueError, match="distill mode must be one of"):
        ppo.compute_advantage(_agent_like_batch(), distill=("logits", torch.zeros(2, 4)))
    a, b = _agent_like_batch(), _agent_like_batch()
    a.scores[:, -1] = b.scores[:, -1] = torch.tensor([1.0, 0.0])
    ppo.compute_advantage(a)
    ppo.compute_advantage(b, distill=None)
    assert torch.equal(a.advantages, b.advantages) and torch.equal(a.token_rewards, b.token_rewards)
