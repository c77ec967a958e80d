"""BaseModel contract: abstract methods, required modules, class table, public state, mask checks."""
import pytest
import torch

from verl_ds.models import BaseModel, MissingModuleError, PolicyModel, PPOModel, RewardModel, ValueModel
from verl_ds.models.base import check_mask, position_ids_from_mask
from verl_ds.registry import model_classes
from verl_ds.state import SharedState


class Toy(BaseModel):
    required_modules = ("encoder",)
    module_types = {"encoder": torch.nn.Module}

    def __init__(self, encoder=None, state=None):
        super().__init__(state=state, encoder=encoder)
        self.temperature_scale = 2.0
        self.history = [1, 2]
        self._cache = {"secret": 1}

    def get_action(self, observation, mask=None, temperature=1.0, top_k=50, top_p=0.95):
        raise self._not_supported("get_action", "toy")

    def get_value(self, observation, mask=None):
        return observation.float().mean(-1)

    def get_logprob(self, observation, action, mask=None):
        raise self._not_supported("get_logprob", "toy")

    def get_reward(self, observation, mask=None):
        raise self._not_supported("get_reward", "toy")

    def update(self, batch, config):
        self._state.set("kl_coef", config["kl_coef"])

    def state_dict(self):
        return super().state_dict()


class HalfDone(BaseModel):  # still abstract: not in the class table
    def get_action(self, *a, **k):
        pass


def test_base_is_abstract_and_six_methods():
    assert BaseModel.__abstractmethods__ == {"get_action", "get_value", "get_logprob", "get_reward", "update",
                                             "state_dict"}
    with pytest.raises(TypeError, match="abstract"):
        BaseModel()
    with pytest.raises(TypeError, match="abstract"):
        HalfDone()


def test_concrete_subclasses_registered():
    classes = model_classes()
    for cls in (Toy, PolicyModel, ValueModel, RewardModel, PPOModel):
        assert classes[cls.__name__] is cls
    assert "HalfDone" not in classes and "BaseModel" not in classes


def test_missing_required_module_message():
    with pytest.raises(MissingModuleError, match=r"^Missing required module: encoder \(Toy was given: encoder=None\)$"):
        Toy()
    assert issubclass(MissingModuleError, ValueError)


def test_wrong_kind_message():
    with pytest.raises(TypeError, match=r"Toy: module 'encoder' must be a Module, got str"):
        Toy(encoder="not a module")
    with pytest.raises(TypeError, match="state must be a SharedState, got dict"):
        Toy(encoder=torch.nn.Linear(1, 1), state={})


def test_state_dict_public_only_and_roundtrip():
    m = Toy(encoder=torch.nn.Linear(2, 2))
    sd = m.state_dict()
    assert sd == {"temperature_scale": 2.0, "history": [1, 2]}  # no _cache, no module weights
    m2 = Toy(encoder=torch.nn.Linear(2, 2))
    m2.temperature_scale = 5.0
    m2.load_state_dict(sd)
    assert m2.temperature_scale == 2.0
    with pytest.raises(KeyError, match="unknown key 'bogus'"):
        m2.load_state_dict({"bogus": 1})


def test_update_writes_hot_state():
    state = SharedState(rank=0)
    m = Toy(encoder=torch.nn.Linear(1, 1), state=state)
    m.update(None, {"kl_coef": 0.5})
    assert state["kl_coef"] == 0.5 and m.state is state


def test_unsupported_method_message():
    m = Toy(encoder=torch.nn.Linear(1, 1))
    with pytest.raises(NotImplementedError, match=r"Toy does not implement get_reward\(\); toy"):
        m.get_reward(torch.zeros(1, 2, dtype=torch.long))


def test_mask_shape_checks():
    obs = torch.ones(2, 5, dtype=torch.long)
    with pytest.raises(ValueError, match=r"mask must have the observation's shape \(B, T\) = \(2, 5\), got "
                                         r"\(2, 5, 5\) \(pass the \(B, T\) attention mask, not a \(B, T, T\)"):
        check_mask(torch.ones(2, 5, 5, dtype=torch.bool), obs, "who")
    with pytest.raises(ValueError, match=r"got \(2, 4\)"):
        check_mask(torch.ones(2, 4, dtype=torch.bool), obs, "who")
    with pytest.raises(ValueError, match="mask row 1 has no real token"):
        check_mask(torch.tensor([[1, 1, 1, 1, 1], [0, 0, 0, 0, 0]]), obs, "who")
    with pytest.raises(ValueError, match="values other than 0/1"):
        check_mask(torch.full((2, 5), 2), obs, "who")
    assert check_mask(torch.ones(2, 5, dtype=torch.long), obs, "who").dtype == torch.bool


def test_position_ids_from_left_padded_mask():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 0]]).bool()
    assert position_ids_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 3]]


def test_observation_checks_and_optimizer_step_messages():
    from verl_ds.models.base import check_observation, optimizer_step

    with pytest.raises(TypeError, match=r"who: observation must be a \(B, T\) int64 tensor of token ids, got list"):
        check_observation([[1, 2]], "who")
    with pytest.raises(ValueError, match=r"who: observation must be 2-D \(B, T\), got shape \(3,\)"):
        check_observation(torch.ones(3, dtype=torch.long), "who")
    with pytest.raises(ValueError, match=r"who: observation is empty: shape \(2, 0\)"):
        check_observation(torch.ones(2, 0, dtype=torch.long), "who")
    with pytest.raises(TypeError, match=r"who: mask must be a \(B, T\) bool tensor, got list"):
        check_mask([[1]], torch.ones(1, 1, dtype=torch.long), "who")
    lin = torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match="Lin.update got a loss but has no optimizer"):
        optimizer_step(lin, None, lin(torch.ones(1, 2)).sum(), 0.1, "Lin")
    with pytest.raises(TypeError, match="Toy.load_state_dict expects a dict, got list"):
        Toy(encoder=lin).load_state_dict([])
