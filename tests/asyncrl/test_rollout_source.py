"""One rollout source interface (``verl_ds.asyncrl.source``): every source implements it, the factory picks the source
for ``rollout.mode`` and placement, the synchronous source gives a failed step's prompts back and adds nothing to the
checkpoint, and the trainer asks its source without checking which one it has (no hasattr/getattr/None checks)."""
import ast
import inspect
from types import SimpleNamespace

import pytest

from verl_ds import trainer as trainer_module
from verl_ds.asyncrl import source as source_module
from verl_ds.asyncrl import split
from verl_ds.asyncrl.producer import AsyncRollout
from verl_ds.asyncrl.source import RolloutRun, RolloutSource, SyncRollout
from verl_ds.asyncrl.split import RemoteRollout, make_rollout_source
from verl_ds.sampler import DistributedPromptSampler

SOURCES = (SyncRollout, AsyncRollout, RemoteRollout)


@pytest.mark.parametrize("cls", SOURCES, ids=lambda c: c.__name__)
def test_each_source_implements_the_interface(cls):
    assert issubclass(cls, RolloutSource) and not cls.__abstractmethods__
    for name in ("next_rollout", "refresh", "rewind", "state_dict", "load_state_dict", "close"):
        mine, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(RolloutSource, name))
        assert list(mine.parameters) == list(theirs.parameters), (cls.__name__, name)
    if cls is not SyncRollout:  # the asynchronous sources keep their queues in the checkpoint and stop generating
        for name in ("state_dict", "load_state_dict", "close"):
            assert getattr(cls, name) is not getattr(RolloutSource, name), (cls.__name__, name)


class _Engine:
    replica, refreshed = None, 0

    def refresh(self):
        self.refreshed += 1


def _run(mode: str, split_ranks: int = 0, sampler=None) -> RolloutRun:
    engine = _Engine()
    actor = SimpleNamespace(rollout_engine=engine)
    cfg = SimpleNamespace(rollout=SimpleNamespace(mode=mode, split_ranks=split_ranks, n=2, stale_samples="drop"),
                          trainer=SimpleNamespace(dist_timeout_s=60.0),
                          algo=SimpleNamespace(dynamic_sampling=False, max_sampling_rounds=1, overlong_buffer=0,
                                               overlong_penalty_factor=1.0))
    state = SimpleNamespace(get=lambda k: 1, snapshot=lambda: {"max_new_tokens": 8, "temperature": 0.7, "top_k": 0,
                                                               "top_p": 1.0, "kl_coef": 0.0})
    return RolloutRun(cfg=cfg, state=state, registry=SimpleNamespace(get=lambda role: {"actor": actor}.get(role)),
                      tokenizer=SimpleNamespace(pad_token_id=0), sampler=sampler or DistributedPromptSampler(16, 4),
                      train_set=list(range(16)), actor_engine=SimpleNamespace(device="cpu"), rank=0,
                      reward_spec=lambda: {"functions": []}, needs_baseline=lambda: False, rollout_fn=None)


@pytest.mark.parametrize("mode, split_ranks, cls", [("sync", 0, SyncRollout), ("one_step_off", 0, AsyncRollout),
                                                     ("streaming", 0, AsyncRollout), ("one_step_off", 1, RemoteRollout),
                                                     ("streaming", 1, RemoteRollout)])
def test_the_factory_picks_the_source_for_the_mode_and_placement(monkeypatch, mode, split_ranks, cls):
    monkeypatch.setitem(split._current, "placement", SimpleNamespace(n_train=1, world=2))
    assert type(make_rollout_source(_run(mode, split_ranks))) is cls


def test_the_sync_source_collects_the_step_and_a_failed_step_gives_its_prompts_back(monkeypatch):
    drawn = []

    def collect(draw_prompts, actor, reward, tokenizer, **kw):
        drawn.append(draw_prompts())
        return kw["sampling"]
    monkeypatch.setattr(source_module, "collect", collect)
    monkeypatch.setattr(RolloutRun, "prompts", lambda self, indices: list(indices))
    run = _run("sync")
    source = SyncRollout(run)
    assert source.next_rollout(1, None) == {"max_new_tokens": 8, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
    source.next_rollout(2, None)
    source.rewind()  # step 2 failed before any update: its prompts are drawn again
    source.next_rollout(2, None)
    assert drawn[1] == drawn[2] != drawn[0]
    source.refresh()
    assert run.registry.get("actor").rollout_engine.refreshed == 1
    # the checkpoint keeps today's format: no "async" part for a synchronous run, and an async run's part is ignored
    assert source.state_dict() is None
    source.load_state_dict({"mode": "streaming", "ranks": []})
    source.close(75)


def test_the_trainer_asks_its_source_without_checking_which_it_has():
    """``self.rollout_source`` appears only as ``self.rollout_source.<method>`` (and its assignment): never bare, so
    never under hasattr/getattr, in a None check or an ``or``."""
    tree = ast.parse(inspect.getsource(trainer_module))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    uses = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "rollout_source"
            and ast.unparse(n.value) == "self"]
    bare = [ast.unparse(parents[n]) for n in uses if isinstance(n.ctx, ast.Load)
            and not isinstance(parents[n], ast.Attribute)]
    assert not bare, bare
    assert sum(isinstance(n.ctx, ast.Store) for n in uses) == 1
    called = {parents[n].attr for n in uses if isinstance(n.ctx, ast.Load)}
    assert called == {"next_rollout", "refresh", "rewind", "state_dict", "load_state_dict", "close"}
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "asyncrl"]
