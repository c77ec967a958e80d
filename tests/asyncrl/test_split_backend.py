"""Split placement's backend choice: the weight broadcast (and the training ranks' group) use NCCL when the ranks
compute on CUDA, gloo on CPU; control messages always take the gloo bridge. On CPU the weights take the bridge
itself (the gloo path, exercised end to end in test_split_weights.py)."""
import torch

from verl_ds.asyncrl.placement import Placement, rank_device, weight_backend


def test_the_weight_backend_follows_the_device():
    assert weight_backend("cpu") == "gloo"
    assert weight_backend(torch.device("cpu")) == "gloo"
    assert weight_backend("cuda") == "nccl"
    assert weight_backend("cuda:3") == "nccl"
    assert weight_backend(torch.device("cuda", 1)) == "nccl"


def test_a_cpu_rank_keeps_its_device_and_sends_the_weights_over_the_bridge():
    assert rank_device("cpu", 5) == "cpu"
    if not torch.cuda.is_available():
        assert rank_device("auto", 1) == "cpu"
    bridge, nccl = object(), object()
    assert Placement("train", bridge, 0, 2, 1).weight_group is bridge  # gloo: no third group
    assert Placement("train", bridge, 0, 2, 1, weights=nccl, device="cuda:0").weight_group is nccl
