"""ModelRegistry: aliases, hot swap under concurrent gets, suggestions, snapshot."""
import threading
import time

import pytest
import torch.nn as nn

from verl_ds.registry import ModelRegistry, UnknownModelError


class Box:
    def __init__(self, tag):
        self.tag = tag


def test_register_get_alias_version():
    reg = ModelRegistry()
    actor = Box("a")
    assert reg.register("ppo_actor", actor, aliases=("actor", "ppo")) == 1
    assert reg.get("actor") is reg.get("ppo") is reg["ppo_actor"] is actor
    assert reg.names() == ["ppo_actor"]
    assert reg.aliases("actor") == ["actor", "ppo"]
    assert reg.aliases() == {"actor": "ppo_actor", "ppo": "ppo_actor"}
    new = Box("b")
    assert reg.register("ppo_actor", new) == 2
    assert reg.get("actor") is new and reg.version("actor") == 2
    assert "ppo" in reg and "nope" not in reg


def test_same_instance_under_two_names():
    reg = ModelRegistry()
    shared = Box("s")
    reg.register("ppo_actor", shared)
    reg.register("dpo_actor", shared)
    assert reg.get("ppo_actor") is reg.get("dpo_actor")


def test_unknown_name_suggests_close_match():
    reg = ModelRegistry()
    reg.register("reward", Box("r"))
    reg.register("critic", Box("c"))
    with pytest.raises(UnknownModelError, match=r"'reward_model' is not registered; did you mean 'reward'\?"):
        reg.get("reward_model")
    with pytest.raises(KeyError, match=r"'critc' is not registered; did you mean 'critic'\?"):
        reg.get("critc")
    assert reg.get("reward_model", None) is None
    sentinel = object()
    assert reg.get("x", sentinel) is sentinel


def test_register_errors():
    reg = ModelRegistry()
    reg.register("actor", Box(1), aliases=("policy",))
    with pytest.raises(ValueError, match="cannot register None as model 'reward'"):
        reg.register("reward", None)
    with pytest.raises(ValueError, match="'policy' is already an alias of 'actor'"):
        reg.register("policy", Box(2))
    with pytest.raises(ValueError, match="alias 'actor' of 'critic' is already a registered model name"):
        reg.register("critic", Box(3), aliases=("actor",))
    reg.register("critic", Box(3))
    with pytest.raises(ValueError, match="alias 'policy' already points to 'actor'"):
        reg.register("critic", Box(3), aliases=("policy",))
    with pytest.raises(ValueError, match="model name must be a non-empty str"):
        reg.register("", Box(4))


def test_unregister_removes_aliases_and_versions_never_repeat():
    reg = ModelRegistry()
    reg.register("reward", Box(1), aliases=("rm",))
    reg.register("reward", Box(2))
    assert reg.unregister("rm").tag == 2
    assert "rm" not in reg and "reward" not in reg
    assert reg.register("reward", Box(3)) == 3


def test_snapshot_counts_parameters_and_ds_numel():
    reg = ModelRegistry()
    lin = nn.Linear(4, 3)  # 15 parameters
    reg.register("critic", lin, aliases=("value",))
    frozen = nn.Linear(2, 2)
    for p in frozen.parameters():
        p.requires_grad_(False)
    reg.register("ref", frozen)
    reg.register("fn", Box(0))
    zero3 = nn.Linear(10, 10)
    zero3.weight.ds_numel = 100  # ZeRO-3 partitioned params report their full size here
    reg.register("z3", zero3)
    snap = {d["name"]: d for d in reg.snapshot()}
    assert snap["critic"] == {**snap["critic"], "aliases": ["value"], "class": "Linear", "version": 1,
                              "trainable": True, "num_parameters": 15}
    assert snap["ref"]["trainable"] is False and snap["ref"]["num_parameters"] == 6
    assert snap["fn"]["trainable"] is None and snap["fn"]["num_parameters"] is None
    assert snap["z3"]["num_parameters"] == 110
    assert isinstance(snap["critic"]["registered_at"], float)


def test_hot_swap_under_concurrent_gets():
    reg = ModelRegistry()
    reg.register("reward", Box(0), aliases=("reward_model",))
    stop = threading.Event()
    bad, seen = [], set()

    def reader():
        while not stop.is_set():
            for name in ("reward", "reward_model"):
                m = reg.get(name)
                if not isinstance(m, Box) or not hasattr(m, "tag"):
                    bad.append(m)
                seen.add(m.tag)

    threads = [threading.Thread(target=reader) for _ in range(6)]
    for t in threads:
        t.start()
    for i in range(1, 300):
        reg.register("reward", Box(i))
        if i % 10 == 0:
            time.sleep(0.0005)  # let the readers run between swaps
    stop.set()
    for t in threads:
        t.join()
    assert not bad
    assert reg.version("reward") == 300 and reg.get("reward_model").tag == 299
    assert len(seen) > 1  # the readers did observe swaps


def test_alias_must_differ_from_name():
    reg = ModelRegistry()
    with pytest.raises(ValueError, match="alias of 'actor' must be a non-empty str other than the name, got 'actor'"):
        reg.register("actor", Box(1), aliases=("actor",))
    with pytest.raises(UnknownModelError, match="'ghost' is not registered"):
        reg.unregister("ghost")
    reg.register("actor", Box(1), aliases="policy")  # a single alias as a str
    assert reg.aliases("actor") == ["policy"] and len(reg) == 1
