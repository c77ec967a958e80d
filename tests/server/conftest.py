"""Fixtures for the control-server tests: a real ControlServer on 127.0.0.1 (helpers in server_testutil)."""
import pytest

from server_testutil import TOKEN, RecordingRewardSwapper, make_registry
from verl_ds.metrics import MetricsLogger
from verl_ds.server import TOKEN_ENV, ControlServer
from verl_ds.state import SharedState


@pytest.fixture
def parts(tmp_path, monkeypatch):
    """The pieces a ControlServer is built from (no server started)."""
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    state = SharedState(rank=0)
    metrics = MetricsLogger(str(tmp_path), enabled=False)
    return {"state": state, "registry": make_registry(), "metrics": metrics,
            "swapper": RecordingRewardSwapper(state), "run_dir": tmp_path}


@pytest.fixture
def server(parts):
    """A started server with a token, a reward swapper and a real MetricsLogger behind /metrics."""
    srv = ControlServer(parts["state"], parts["registry"], host="127.0.0.1", port=0, token=TOKEN,
                        max_body_bytes=1024, run_dir=parts["run_dir"], metrics_fn=parts["metrics"].snapshot,
                        reward_swapper=parts["swapper"], request_timeout=2.0)
    srv.start()
    yield srv
    srv.stop()
