"""Tiny HF models built from configs (no downloads) and rollout batches for the Models tests."""
import pytest
import torch

from models_testutil import make_rollout_batch, tiny_llama_config


@pytest.fixture(scope="session")
def llama_config():
    return tiny_llama_config()


@pytest.fixture
def tiny_lm(llama_config):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    return LlamaForCausalLM(llama_config).eval()


@pytest.fixture
def tiny_critic(llama_config):
    from verl_ds.models import CriticLM

    torch.manual_seed(2)
    return CriticLM.from_causal_lm_config(llama_config).eval()


@pytest.fixture
def tiny_scorer():
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(3)
    return LlamaForSequenceClassification(tiny_llama_config(num_labels=1)).eval()


@pytest.fixture
def make_rollout():
    return make_rollout_batch
