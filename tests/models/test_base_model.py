"""BaseModel and the role contracts: abstract roles, required modules, the class table, public state (tensors
included, the unsaveable refused), mask/observation checks, optimizer_step with a hand-computed gradient."""
import dataclasses
import threading

import pytest
import torch

from verl_ds.algos import make_kl_controller
from verl_ds.models import (ActionRole, BaseModel, LogProbRole, MissingModuleError, PolicyModel, PPOModel,
                            ReferenceModel, RewardModel, RewardRole, TrainableRole, ValueModel, ValueRole)
from verl_ds.models.base import optimizer_step
from verl_ds.registry import model_classes
from verl_ds.state import SharedState

ROLES = {ActionRole: "get_action", LogProbRole: "get_logprob", ValueRole: "get_value", RewardRole: "get_reward",
         TrainableRole: "update"}


@dataclasses.dataclass
class Knobs:
    scale: float = 1.0
    name: str = "a"


class Toy(ValueRole, TrainableRole):
    required_modules = ("encoder",)
    module_types = {"encoder": torch.nn.Module}

    def __init__(self, encoder=None, state=None):
        super().__init__(state=state, encoder=encoder)
        self.temperature_scale = 2.0
        self.history = [1, 2]
        self.cache_buffer = torch.zeros(3)  # issue 11 defect 6: public tensors used to vanish from state_dict
        self.knobs = Knobs()
        self.controller = make_kl_controller("band", init_kl_coef=0.1, target_kl=0.05)
        self.head = torch.nn.Linear(1, 1)  # weights belong to the engine checkpoints: skipped
        self._cache = {"secret": 1}

    def get_value(self, observation, mask=None):
        return observation.float().mean(-1)

    def update(self, batch, config):
        self._state.set("kl_coef", config["kl_coef"])


class HalfDone(ValueRole, TrainableRole):  # update is missing: still abstract, not in the class table
    def get_value(self, observation, mask=None):
        return observation.float()


def test_roles_are_abstract_with_one_method_each():
    for role, method in ROLES.items():
        assert role.__abstractmethods__ == {method}, role
        assert issubclass(role, BaseModel)
        with pytest.raises(TypeError, match="abstract"):
            role()
    with pytest.raises(TypeError, match="abstract"):
        HalfDone()
    assert BaseModel.__abstractmethods__ == frozenset()  # the methods live on the roles now


def test_components_have_only_their_roles_methods():
    have = {
        PolicyModel: {"get_action", "get_logprob", "update"},
        ReferenceModel: {"get_logprob"},
        ValueModel: {"get_value", "update"},
        RewardModel: {"get_reward"},
        PPOModel: {"update"},
    }
    for cls, methods in have.items():
        for method in ROLES.values():
            assert hasattr(cls, method) == (method in methods), (cls.__name__, method)
        assert hasattr(cls, "state_dict") and hasattr(cls, "load_state_dict")


def test_concrete_subclasses_registered():
    classes = model_classes()
    for cls in (Toy, PolicyModel, ReferenceModel, ValueModel, RewardModel, PPOModel):
        assert classes[cls.__name__] is cls
    for name in ("HalfDone", "BaseModel", "ActionRole", "ValueRole", "TrainableRole"):
        assert name not in classes


def test_missing_required_module_message():
    with pytest.raises(MissingModuleError, match=r"^Missing required module: encoder \(Toy was given: encoder=None\)$"):
        Toy()
    assert issubclass(MissingModuleError, ValueError)


def test_wrong_kind_message():
    with pytest.raises(TypeError, match=r"Toy: module 'encoder' must be a Module, got str"):
        Toy(encoder="not a module")
    with pytest.raises(TypeError, match="state must be a SharedState, got dict"):
        Toy(encoder=torch.nn.Linear(1, 1), state={})


def test_state_dict_saves_public_state_tensors_included():
    m = Toy(encoder=torch.nn.Linear(2, 2))
    m.cache_buffer += torch.tensor([1.0, 2.0, 3.0])
    sd = m.state_dict()
    assert set(sd) == {"temperature_scale", "history", "cache_buffer", "knobs", "controller"}  # no _cache/modules
    assert sd["temperature_scale"] == 2.0 and sd["history"] == [1, 2]
    assert sd["cache_buffer"].tolist() == [1.0, 2.0, 3.0]
    assert sd["knobs"] == {"scale": 1.0, "name": "a"}
    assert sd["controller"]["kind"] == "band" and sd["controller"]["value"] == 0.1
    m.cache_buffer[0] = 99.0  # a copy, not a view
    m.history.append(3)
    assert sd["cache_buffer"][0] == 1.0 and sd["history"] == [1, 2]


def test_state_dict_detaches_tensors_that_need_grad():
    m = Toy(encoder=torch.nn.Linear(2, 2))
    m.cache_buffer = torch.ones(2, requires_grad=True) * 3  # a non-leaf with a graph
    saved = m.state_dict()["cache_buffer"]
    assert not saved.requires_grad and saved.grad_fn is None and saved.tolist() == [3.0, 3.0]


def test_state_dict_refuses_what_it_cannot_save():
    m = Toy(encoder=torch.nn.Linear(2, 2))
    m.lock = threading.Lock()
    with pytest.raises(TypeError, match=r"Toy.state_dict: public attribute 'lock' holds a lock, which cannot be saved "
                                        r"in a checkpoint; make it private \(self._lock\)"):
        m.state_dict()


def test_load_state_dict_roundtrip():
    src = Toy(encoder=torch.nn.Linear(2, 2))
    src.temperature_scale, src.history = 5.0, [7]
    src.cache_buffer = torch.tensor([4.0, 5.0, 6.0])
    src.knobs = Knobs(scale=3.0, name="b")
    src.controller.update(1.0)  # KL 1.0 > 1.5 * 0.05: x1.5
    sd = src.state_dict()
    dst = Toy(encoder=torch.nn.Linear(2, 2))
    dst.cache_buffer = torch.zeros(3, dtype=torch.float64)
    dst.load_state_dict(sd)
    assert dst.temperature_scale == 5.0 and dst.history == [7] and dst.knobs == Knobs(3.0, "b")
    assert dst.cache_buffer.dtype == torch.float64 and dst.cache_buffer.tolist() == [4.0, 5.0, 6.0]
    assert dst.controller.value == pytest.approx(0.15)
    dst.history.append(8)  # loaded values are copies
    assert sd["history"] == [7]


def test_load_state_dict_errors():
    m = Toy(encoder=torch.nn.Linear(2, 2))
    with pytest.raises(KeyError, match=r"Toy.load_state_dict: unknown key 'bogus'; known: \['cache_buffer', "):
        m.load_state_dict({"bogus": 1})
    for not_state in ("get_value", "state", "encoder", "head", "_cache"):  # methods, properties, modules, private
        with pytest.raises(KeyError, match=f"unknown key '{not_state}'"):
            m.load_state_dict({not_state: 1})
    assert callable(m.get_value) and isinstance(m.encoder, torch.nn.Linear)
    with pytest.raises(TypeError, match="Toy.load_state_dict expects a dict, got list"):
        m.load_state_dict([])


def test_update_writes_hot_state():
    state = SharedState(rank=0)
    m = Toy(encoder=torch.nn.Linear(1, 1), state=state)
    m.update(None, {"kl_coef": 0.5})
    assert state["kl_coef"] == 0.5 and m.state is state


def test_optimizer_step_hand_case():
    lin = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, -1.0]]))
    opt = torch.optim.SGD(lin.parameters(), lr=10.0)
    loss = lin(torch.tensor([[3.0, 4.0]])).sum()  # d loss / d w = (3, 4): norm 5
    out = optimizer_step(lin, opt, loss, 0.1, "Lin")
    assert out["skipped"] is False and out["zero_stage"] == 0 and float(out["grad_norm"]) == pytest.approx(5.0)
    assert opt.param_groups[0]["lr"] == 0.1  # the hot learning rate was written first
    torch.testing.assert_close(lin.weight.detach(), torch.tensor([[1.0 - 0.3, -1.0 - 0.4]]))
    assert lin.weight.grad is None
    loss = lin(torch.tensor([[3.0, 4.0]])).sum()
    out = optimizer_step(lin, opt, loss, None, "Lin", skip=True)  # lr None: left as it is
    assert out["skipped"] is True and float(out["grad_norm"]) == pytest.approx(5.0)
    torch.testing.assert_close(lin.weight.detach(), torch.tensor([[0.7, -1.4]]))
    assert lin.weight.grad is None and opt.param_groups[0]["lr"] == 0.1


def test_optimizer_step_messages():
    lin = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="Lin.update got a loss but has no optimizer"):
        optimizer_step(lin, None, lin(torch.ones(1, 2)).sum(), 0.1, "Lin")
    with pytest.raises(ValueError, match=r"Lin.update: config\['loss'\] must be a scalar tensor that requires grad, "
                                         r"got Tensor\(2,\)"):
        optimizer_step(lin, None, torch.ones(2, requires_grad=True), 0.1, "Lin")
    with pytest.raises(ValueError, match=r"must be a scalar tensor that requires grad, got float"):
        optimizer_step(lin, None, 1.0, 0.1, "Lin")
