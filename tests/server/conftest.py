"""Fixtures for the control-server tests: a real ControlServer on 127.0.0.1 (helpers in server_testutil)."""
import os

import pytest
from server_testutil import TOKEN, RecordingRewardSwapper, make_registry, save_tiny_reward_model

from verl_ds.metrics import MetricsLogger
from verl_ds.server import TOKEN_ENV, ControlServer
from verl_ds.state import SharedState


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """The pieces a ControlServer is built from (no server started)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    state = SharedState(rank=0)
    metrics = MetricsLogger(str(tmp_path), enabled=False)
    rm_dir = tmp_path / "reward_models"
    rm_dir.mkdir()
    return {"state": state, "registry": make_registry(), "metrics": metrics,
            "swapper": RecordingRewardSwapper(state), "run_dir": tmp_path, "rm_dir": str(rm_dir)}


@pytest.fixture
def server(parts):
    """A started server with a token, a reward swapper, a reward model directory and a real MetricsLogger
    behind /metrics."""
    srv = ControlServer(parts["state"], parts["registry"], host="127.0.0.1", port=0, token=TOKEN,
                        max_body_bytes=1024, run_dir=parts["run_dir"], metrics_fn=parts["metrics"].snapshot,
                        reward_swapper=parts["swapper"], request_timeout=2.0, reward_model_dir=parts["rm_dir"])
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def reward_ckpt(tmp_path_factory):
    """A real tiny 1-label sequence-classification checkpoint (vocab 64), saved once per session."""
    return save_tiny_reward_model(str(tmp_path_factory.mktemp("rm") / "tiny_rm"))


@pytest.fixture
def rm_in_dir(parts, reward_ckpt):
    """The tiny checkpoint copied under the server's reward model directory."""
    import shutil

    dst = os.path.join(parts["rm_dir"], "tiny_rm")
    shutil.copytree(reward_ckpt, dst)
    return dst
