"""CriticLM and ValueModel: values aligned with response tokens (hand-built cases), shape contracts, a failing value
function named with what it was given, update with a hand-computed step, checkpoints."""
import pytest
import torch

from verl_ds.models import CriticLM, ValueModel
from verl_ds.state import SharedState

from models_testutil import EOS, PAD, TokenValueNet, tiny_llama_config

VALUES = {3: 0.5, 4: -1.0, 5: 2.0, 6: 0.25, 7: 3.0, EOS: -2.0}


def test_get_values_hand_alignment():
    """The value before response token j is the value of the state after the token preceding it."""
    vm = ValueModel(TokenValueNet(VALUES))
    # prompt [PAD, 3, 4] (P=3), response 5 6 EOS | prompt [3, 7, 7], response 6 then padding
    obs = torch.tensor([[PAD, 3, 4, 5, 6, EOS], [3, 7, 7, 6, PAD, PAD]])
    mask = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]]).bool()
    vals = vm.get_values(obs, mask, 3)
    assert vals.shape == (2, 3) and vals.dtype == torch.float32
    # row 0: states after 4, 5, 6; row 1: after 7, 6, PAD (the last two are padding, masked by the caller)
    assert vals.tolist() == [[-1.0, 2.0, 0.25], [3.0, 0.25, 0.0]]
    # get_value: the value at the last REAL token of each row (EOS for row 0, 6 for row 1)
    assert vm.get_value(obs, mask).tolist() == [-2.0, 0.25]
    assert vm.get_value(obs).tolist() == [-2.0, 0.0]  # no mask: every column is real


def test_get_values_is_differentiable_with_hand_gradient():
    net = TokenValueNet(VALUES)
    vm = ValueModel(net)
    obs = torch.tensor([[3, 4, 4, 5]])
    vm.get_values(obs, None, 2).sum().backward()  # values after tokens 4 (position 1) and 4 (position 2)
    want = torch.zeros_like(net.table)
    want[4] = 2.0
    torch.testing.assert_close(net.table.grad, want)


def test_callable_value_function_shapes():
    obs = torch.tensor([[3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    seq = ValueModel(lambda o: o.float().mean(-1))
    assert seq.get_value(obs).tolist() == [5.5, 11.5]
    with pytest.raises(ValueError, match=r"per-token values need a \(B, T\) output; the value function returned "
                                         r"\(2,\)"):
        seq.get_values(obs, None, 2)
    tok = ValueModel(lambda o: o.double() * 0.5)  # float64 is converted
    out = tok.get_values(obs, None, 2)
    assert out.dtype == torch.float32 and out.tolist() == [[3.0, 3.5], [6.0, 6.5]]
    assert tok.get_value(obs).tolist() == [4.0, 7.0]


def test_b1_output_is_an_error_that_says_squeeze():
    obs = torch.randint(3, 20, (3, 6))
    vm = ValueModel(lambda o: torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"returned shape \(B, 1\) = \(3, 1\); return \(B,\) for a sequence value "
                                         r"\(squeeze the last dim"):
        vm.get_value(obs)


def test_value_function_output_errors():
    obs = torch.randint(3, 20, (3, 6))
    with pytest.raises(ValueError, match=r"returned shape \(3, 5\); expected \(B,\) = \(3,\) or \(B, T\) = \(3, 6\)"):
        ValueModel(lambda o: torch.zeros(3, 5)).get_value(obs)
    with pytest.raises(TypeError, match="must return floating-point values, got dtype torch.int64"):
        ValueModel(lambda o: o).get_value(obs)
    with pytest.raises(TypeError, match="must return a Tensor, got list"):
        ValueModel(lambda o: [0.0] * 3).get_value(obs)
    with pytest.raises(ValueError, match="returned non-finite values"):
        ValueModel(lambda o: torch.full((3,), float("nan"))).get_value(obs)
    with pytest.raises(TypeError, match="net must be an nn.Module or a callable"):
        ValueModel(42)
    with pytest.raises(ValueError, match=r"response_length \(the response width R\) must be an int with 1 <= R < T=6"):
        ValueModel(lambda o: o.float()).get_values(obs, None, 6)
    with pytest.raises(ValueError, match="Missing required module: net"):
        ValueModel(None)


class NeedsTwoArgs(Exception):
    def __init__(self, code, detail):
        super().__init__(f"{code}: {detail}")


def test_failing_value_function_named_with_its_input():
    """Issue 11 defect 7: an exception inside a user value function says which model and what it was given."""
    obs = torch.randint(3, 20, (3, 6))

    def broken(o):
        raise KeyError("no such column")

    with pytest.raises(KeyError, match=r"ValueModel: the value function 'broken' failed on observation of shape "
                                       r"\(3, 6\) and dtype torch.int64 \(token ids\): "
                                       r"KeyError: 'no such column'") as e:
        ValueModel(broken).get_value(obs)
    assert isinstance(e.value.__cause__, KeyError)

    def odd(o):
        raise NeedsTwoArgs(7, "bad state")

    # an exception type that cannot be rebuilt from one message still reaches the user with the same text
    with pytest.raises(RuntimeError, match=r"the value function 'odd' failed on observation of shape \(3, 6\) and "
                                           r"dtype torch.int64 \(token ids\): NeedsTwoArgs: 7: bad state") as e:
        ValueModel(odd).get_values(obs, None, 2)
    assert isinstance(e.value.__cause__, NeedsTwoArgs)


def test_roles_and_state_dict():
    vm = ValueModel(TokenValueNet(VALUES))
    for name in ("get_action", "get_logprob", "get_reward"):
        assert not hasattr(vm, name), name
    assert vm.state_dict() == {"lr_key": "critic_lr"}
    vm.load_state_dict({"lr_key": "other_lr"})
    assert vm.lr_key == "other_lr"


def test_update_steps_at_hot_lr_with_hand_values():
    net = TokenValueNet(VALUES)
    state = SharedState(rank=0)
    state.set("critic_lr", 0.25)
    opt = torch.optim.SGD(net.parameters(), lr=9.0)
    vm = ValueModel(net, state=state, optimizer=opt)
    obs = torch.tensor([[3, 4, 5]])
    loss = vm.get_values(obs, None, 2).sum()  # V(3) + V(4): gradient 1 on both entries, norm sqrt(2)
    out = vm.update(None, {"loss": loss})
    assert out["skipped"] is False and float(out["grad_norm"]) == pytest.approx(2 ** 0.5)
    assert opt.param_groups[0]["lr"] == 0.25
    assert net.table[3].item() == pytest.approx(0.25) and net.table[4].item() == pytest.approx(-1.25)
    assert net.table[5].item() == 2.0
    out = vm.update(None, {"loss": vm.get_values(obs, None, 2).sum(), "skip": True})
    assert out["skipped"] is True and net.table[3].item() == pytest.approx(0.25)
    with pytest.raises(ValueError, match="ValueModel.update: config must hold 'loss'"):
        vm.update(None, {})
    with pytest.raises(ValueError, match="a plain value function has no parameters to train"):
        ValueModel(lambda o: o.float()).update(None, {"loss": torch.ones((), requires_grad=True)})


# ---- CriticLM on a real Llama backbone -----------------------------------------------------------------------------

def test_critic_forward_shape_and_small_init(tiny_critic, make_rollout):
    b = make_rollout()
    pos = (b.mask.long().cumsum(-1) - 1).clamp(min=0)
    v = tiny_critic(b.observation, b.mask.long(), pos)
    assert v.shape == b.observation.shape and v.dtype == torch.float32
    assert v.abs().max() < 0.5  # small head init
    assert tiny_critic.value_head.bias.item() == 0.0


def test_critic_values_match_prefix_forwards(tiny_critic, make_rollout):
    """Reference without shared slicing: the value before response token j is the critic's last-position output on
    the unpadded prefix that precedes it (causal attention: later tokens cannot change it)."""
    b = make_rollout()
    vm = ValueModel(tiny_critic)
    with torch.no_grad():
        vals = vm.get_values(b.observation, b.mask, b.response_width)
        last = vm.get_value(b.observation, b.mask)
    for i in range(len(b)):
        real = b.observation[i][b.mask[i]]
        n_prompt = int(b.prompt_length[i])
        with torch.no_grad():
            full = tiny_critic(real[None])[0]  # (T_i,) over the real tokens only
        for j in range(int(b.response_length[i])):
            assert vals[i, j].item() == pytest.approx(full[n_prompt + j - 1].item(), abs=1e-5), (i, j)
        assert last[i].item() == pytest.approx(full[-1].item(), abs=1e-5)


def test_left_padding_does_not_change_values(tiny_critic):
    vm = ValueModel(tiny_critic)
    seq = torch.tensor([[7, 8, 9, 10]])
    padded = torch.tensor([[PAD, PAD, 7, 8, 9, 10]])
    with torch.no_grad():
        a = vm.get_values(seq, None, 2)
        c = vm.get_values(padded, padded != PAD, 2)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=0)


def test_critic_from_pretrained_causal_lm_and_roundtrip(tmp_path, tiny_lm):
    tiny_lm.save_pretrained(tmp_path / "lm")
    critic = CriticLM.from_pretrained(tmp_path / "lm", torch_dtype=torch.float32)
    for (name, p), (_, q) in zip(critic.backbone.state_dict().items(), tiny_lm.model.state_dict().items()):
        assert torch.equal(p, q), name
    with torch.no_grad():
        critic.value_head.weight.fill_(0.5)
    critic.save_pretrained(tmp_path / "critic")
    again = CriticLM.from_pretrained(tmp_path / "critic")
    assert torch.equal(again.value_head.weight, critic.value_head.weight)


def test_token_classifier_critic_accepted():
    from transformers import LlamaForTokenClassification

    net = LlamaForTokenClassification(tiny_llama_config(num_labels=1)).eval()
    vm = ValueModel(net)
    obs = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    with torch.no_grad():
        vals = vm.get_values(obs, None, 2)  # (B, T, 1) logits squeezed; states after tokens 7 and 8 (12 and 13)
        for j, cut in enumerate((3, 4)):
            prefix = net(input_ids=obs[:, :cut]).logits[:, -1, 0]
            torch.testing.assert_close(vals[:, j], prefix, atol=1e-5, rtol=0)


def test_critic_needs_hidden_size_without_config():
    with pytest.raises(ValueError, match="pass hidden_size when the backbone has no HF config"):
        CriticLM(torch.nn.Identity())
    assert CriticLM(torch.nn.Identity(), hidden_size=8).value_head.in_features == 8
