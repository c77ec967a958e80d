"""The packing tests run tiny models: one intra-op thread. With two, OpenMP's spin-waiting on a loaded
2-core machine made them ~8x slower (2.6 s vs 20 s for the same test)."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
