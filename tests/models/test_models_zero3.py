"""The models over DeepSpeed ZeRO-3 engines (1 rank, gloo, in a subprocess): the same numbers as the plain
modules, an optimizer step through PolicyModel.update, the reward scorer's per-token capture under
partitioned parameters, and the registry counting partitioned parameters through ds_numel."""
import json
import os
import socket
import subprocess
import sys
import tempfile

import pytest

pytestmark = pytest.mark.slow  # real training runs / several processes

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

WORKER = r'''
import json, sys
import torch
import deepspeed
from transformers import LlamaForCausalLM, LlamaForSequenceClassification

sys.path.insert(0, sys.argv[2])
from models_testutil import make_rollout_batch, tiny_llama_config
from verl_ds.models import CriticLM, PolicyModel, RewardModel, ValueModel
from verl_ds.registry import ModelRegistry
from verl_ds.state import SharedState

deepspeed.init_distributed(dist_backend="gloo")
torch.manual_seed(0)
lm = LlamaForCausalLM(tiny_llama_config()).eval()
critic = CriticLM.from_causal_lm_config(tiny_llama_config()).eval()
scorer = LlamaForSequenceClassification(tiny_llama_config(num_labels=1)).eval()
b = make_rollout_batch()
n_lm = sum(p.numel() for p in lm.parameters())
with torch.no_grad():
    ref_lp = PolicyModel(lm).get_logprob(b.observation, b.action, b.mask)
    ref_v = ValueModel(critic).get_values(b.observation, b.mask, b.response_width)
    plain_rm = RewardModel(model=scorer)
    ref_s = plain_rm.get_reward(b.observation, b.mask)
    plain_rm.close()

ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "zero_optimization": {"stage": 3},
      "zero_allow_untested_optimizer": True}
actor, *_ = deepspeed.initialize(model=lm, optimizer=torch.optim.AdamW(lm.parameters(), lr=0.1), config=ds)
critic_e, *_ = deepspeed.initialize(model=critic, optimizer=torch.optim.AdamW(critic.parameters(), lr=0.1), config=ds)
scorer_e, *_ = deepspeed.initialize(model=scorer, config=ds)
out = {"partitioned": all(p.numel() == 0 for p in actor.module.parameters())}

state = SharedState(rank=0)
state.set("actor_lr", 0.01)
policy = PolicyModel(actor, state=state)
with torch.no_grad():
    lp = policy.get_logprob(b.observation, b.action, b.mask)
    out["logprob_diff"] = float(((lp - ref_lp) * b.response_mask).abs().max())
    a, alp, ent = policy.get_action(b.observation[:, :5], b.mask[:, :5], max_new_tokens=2)
    out["action_ok"] = bool(a.shape == (4, 2) and torch.isfinite(alp).all() and (ent >= 0).all())
    out["value_diff"] = float((ValueModel(critic_e).get_values(b.observation, b.mask, 4) - ref_v).abs().max())
    out["score_diff"] = float((RewardModel(model=scorer_e).get_reward(b.observation, b.mask) - ref_s).abs().max())

loss = -(policy.get_logprob(b.observation, b.action, b.mask) * b.response_mask).sum() / b.response_mask.sum()
policy.update(b, {"loss": loss})
out["lr"] = actor.optimizer.param_groups[0]["lr"]
with torch.no_grad():
    after = policy.get_logprob(b.observation, b.action, b.mask)
out["logprob_gain"] = float(((after - lp) * b.response_mask).sum() / b.response_mask.sum())

reg = ModelRegistry()
reg.register("actor", policy)
out["registry_params"] = reg.snapshot()[0]["num_parameters"]
out["n_lm"] = n_lm
with open(sys.argv[1], "w") as f:
    json.dump(out, f)
'''


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.timeout(1200)
def test_models_over_zero3_engines():
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(WORKER)
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(_free_port()), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "PYTHONWARNINGS": "ignore::FutureWarning",
               "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(ROOT, ".torch_ext"))}
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.run([sys.executable, script, result, HERE], env=env, capture_output=True, text=True,
                              timeout=900)  # generous: CI machines are shared
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        with open(result) as f:
            out = json.load(f)
    assert out["partitioned"]  # the engines really hold ZeRO-3 partitioned parameters
    assert out["logprob_diff"] < 1e-5 and out["value_diff"] < 1e-5 and out["score_diff"] < 1e-5
    assert out["action_ok"]
    assert out["lr"] == 0.01  # the hot learning rate from SharedState
    assert out["logprob_gain"] > 0  # one step of maximising the log-likelihood raised it
    assert out["registry_params"] == out["n_lm"]
