"""CriticLM and ValueModel: alignment with response tokens, shape contracts, checkpoints."""
import pytest
import torch

from verl_ds.models import CriticLM, ValueModel
from verl_ds.state import SharedState

from models_testutil import PAD


def test_critic_forward_shape_and_small_init(tiny_critic, make_rollout):
    b = make_rollout()
    pos = (b.mask.long().cumsum(-1) - 1).clamp(min=0)
    v = tiny_critic(b.observation, b.mask.long(), pos)
    assert v.shape == b.observation.shape and v.dtype == torch.float32
    assert v.abs().max() < 0.5  # small head init
    assert tiny_critic.value_head.bias.item() == 0.0


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


def test_get_value_at_last_real_token_and_get_values_alignment(tiny_critic, make_rollout):
    b = make_rollout()
    vm = ValueModel(tiny_critic)
    pos = (b.mask.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        full = tiny_critic(b.observation, b.mask.long(), pos)
    v = vm.get_value(b.observation, b.mask)
    last = b.prompt_width + b.response_length - 1
    torch.testing.assert_close(v, full[torch.arange(4), last])
    R = b.response_width
    vals = vm.get_values(b.observation, b.mask, R)
    assert vals.shape == (4, R)
    torch.testing.assert_close(vals, full[:, -R - 1:-1])  # the state before each response token
    vals.sum().backward()
    assert tiny_critic.value_head.weight.grad is not None


def test_left_padding_does_not_change_values(tiny_critic):
    vm = ValueModel(tiny_critic)
    seq = torch.tensor([[7, 8, 9, 10]])
    padded = torch.tensor([[PAD, PAD, 7, 8, 9, 10]])
    with torch.no_grad():
        a = vm.get_values(seq, None, 2)
        c = vm.get_values(padded, padded != PAD, 2)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=0)


def test_callable_value_function_shapes():
    obs = torch.randint(3, 20, (3, 6))
    seq = ValueModel(lambda o: o.float().mean(-1))
    torch.testing.assert_close(seq.get_value(obs), obs.float().mean(-1))
    with pytest.raises(ValueError, match=r"per-token values need a \(B, T\) output; the value function returned \(3,\)"):
        seq.get_values(obs, None, 2)
    tok = ValueModel(lambda o: o.double() * 0.5)  # float64 is converted
    out = tok.get_values(obs, None, 2)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, obs[:, -3:-1].float() * 0.5)
    torch.testing.assert_close(tok.get_value(obs), obs[:, -1].float() * 0.5)


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


def test_token_classifier_critic_accepted():
    from transformers import LlamaForTokenClassification

    from models_testutil import tiny_llama_config

    net = LlamaForTokenClassification(tiny_llama_config(num_labels=1)).eval()
    vm = ValueModel(net)
    obs = torch.randint(3, 20, (2, 5))
    with torch.no_grad():
        ref = net(input_ids=obs).logits.squeeze(-1)
        torch.testing.assert_close(vm.get_values(obs, None, 2), ref[:, -3:-1].float())


def test_critic_update_and_unsupported(tiny_critic, make_rollout):
    b = make_rollout()
    state = SharedState(rank=0)
    state.set("critic_lr", 0.05)
    opt = torch.optim.SGD(tiny_critic.parameters(), lr=1.0)
    vm = ValueModel(tiny_critic, state=state, optimizer=opt)
    w = tiny_critic.value_head.weight.detach().clone()
    loss = vm.get_values(b.observation, b.mask, 4).pow(2).mean() + 1.0 * vm.get_values(b.observation, b.mask, 4).mean()
    vm.update(b, {"loss": loss})
    assert opt.param_groups[0]["lr"] == 0.05 and not torch.equal(w, tiny_critic.value_head.weight)
    with pytest.raises(NotImplementedError, match="a critic does not act; use PolicyModel"):
        vm.get_action(b.observation)
    with pytest.raises(ValueError, match="a plain value function has no parameters to train"):
        ValueModel(lambda o: o.float()).update(b, {"loss": loss.detach().requires_grad_()})


def test_critic_needs_hidden_size_without_config():
    with pytest.raises(ValueError, match="pass hidden_size when the backbone has no HF config"):
        CriticLM(torch.nn.Identity())
    assert CriticLM(torch.nn.Identity(), hidden_size=8).value_head.in_features == 8
