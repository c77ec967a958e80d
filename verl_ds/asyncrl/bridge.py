"""The split placement's messages over the bridge group (``verl_ds.asyncrl.split``, ``split_stream``): control
broadcasts from training rank 0 and pickled objects point to point, among the job's own ranks only."""
from __future__ import annotations

import pickle

import torch

from verl_ds.asyncrl.placement import Placement
from verl_ds.rollout import Rollout

_STOP, _WEIGHTS, _REQUEST, _SAVE = 0, 1, 2, 3  # _SAVE: streaming's queues into a checkpoint (split_state)


def _send_obj(bridge, obj, dst: int) -> None:
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)  # the job's own ranks only
    bridge.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, 0).wait()
    bridge.send([data], dst, 1).wait()


def _recv_obj(bridge, src: int):
    n = torch.zeros(1, dtype=torch.int64)
    bridge.recv([n], src, 0).wait()
    data = torch.empty(int(n), dtype=torch.uint8)
    bridge.recv([data], src, 1).wait()
    return pickle.loads(data.numpy().tobytes())


def _control(bridge, cmd: int = _STOP, code: int = 0, payload=None):
    """Broadcast (cmd, code) and a small object from training rank 0; returns them on every rank."""
    head = torch.tensor([cmd, code], dtype=torch.int64)
    bridge.broadcast(head, 0).wait()
    size = torch.tensor([0 if payload is None else len(pickle.dumps(payload))], dtype=torch.int64)
    bridge.broadcast(size, 0).wait()
    # only rank 0's payload is sent: another rank's own (same step, maybe pickled to another length) would not fit
    data = torch.frombuffer(bytearray(pickle.dumps(payload)), dtype=torch.uint8) if bridge.rank() == 0 else \
        torch.empty(int(size), dtype=torch.uint8)
    if int(size):
        bridge.broadcast(data, 0).wait()
    return int(head[0]), int(head[1]), pickle.loads(data.numpy().tobytes()) if int(size) else None


def send_rollout(placement: Placement, ro: Rollout, dst: int) -> None:
    """One training rank's scored batch, as plain host data over the gloo bridge: fields, extras, texts, metrics and
    per-sample reward values."""
    b = ro.batch.to("cpu")
    metrics = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in ro.metrics.items()}
    _send_obj(placement.bridge, {"fields": {f: b[f] for f in b.present()}, "extras": dict(b.extras),
                                 "responses": ro.responses, "metrics": metrics,
                                 "per_sample": {k: v.cpu() for k, v in ro.per_sample.items()}}, dst)
