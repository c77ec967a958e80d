"""Tiny HF models built from configs and padded batches for the packing tests, and the obviously-correct
reference: every sequence run alone, without padding (a plain module: conftest.py names clash across folders)."""
import os

import torch

VOCAB = 151


def tiny_config(kind="llama", **overrides):
    from transformers import LlamaConfig, Qwen2Config

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    return (LlamaConfig if kind == "llama" else Qwen2Config)(**kw)


def tiny_lm(kind="llama", seed=0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(kind, **overrides), attn_implementation="sdpa").float()


def tiny_critic(kind="llama", seed=0):
    from verl_ds.models import CriticLM

    torch.manual_seed(seed)
    critic = CriticLM.from_causal_lm_config(tiny_config(kind), attn_implementation="sdpa")
    torch.nn.init.normal_(critic.value_head.weight, std=0.5)  # values far from 0, so differences show
    return critic


def padded_batch(prompt_lens, response_lens, P, R, prompt_side="left", seed=0):
    """(observation (B, P + R), mask): prompts padded on ``prompt_side`` to P, responses right-padded to R."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompt_lens)
    obs = torch.randint(3, VOCAB, (B, P + R), generator=g)
    mask = torch.zeros(B, P + R, dtype=torch.bool)
    for b, (pl, rl) in enumerate(zip(prompt_lens, response_lens)):
        if prompt_side == "left":
            mask[b, P - pl:P] = True
        else:
            mask[b, :pl] = True
        mask[b, P:P + rl] = True
    return torch.where(mask, obs, 0), mask


def per_sequence_reference(lm, critic, obs, mask, R, temperature):
    """Each row's real tokens run alone (no padding, no packing): float64 log_softmax log-probs and entropies
    of its real response tokens, and the critic's values before them; (B, R) tensors, 0 at padding.
    Differentiable (the tests compare gradients)."""
    B, T = obs.shape
    lp = torch.zeros(B, R, dtype=torch.float64)
    ent = torch.zeros(B, R, dtype=torch.float64)
    val = torch.zeros(B, R) if critic is not None else None
    for b in range(B):
        cols = mask[b].nonzero().flatten()
        ids = obs[b, cols].unsqueeze(0)
        resp = (cols >= T - R).nonzero().flatten()  # response tokens' places in the unpadded sequence
        out_cols = cols[resp] - (T - R)
        ls = torch.log_softmax(lm(input_ids=ids, use_cache=False).logits[0, resp - 1].double() / temperature, -1)
        lp[b, out_cols] = ls.gather(-1, ids[0, resp].unsqueeze(-1)).squeeze(-1)
        ent[b, out_cols] = -(ls.exp() * ls).sum(-1)
        if critic is not None:
            val[b, out_cols] = critic(input_ids=ids)[0, resp - 1]
    return lp, ent, val


def run_zero3_worker(source: str, timeout: float = 400) -> dict:
    """Run ``source`` (a script that writes a JSON dict to sys.argv[1]; sys.argv[2] is tests/packing) as rank 0 of
    a one-rank torch.distributed job on the CPU accelerator, and return that dict."""
    import json
    import socket
    import subprocess
    import sys
    import tempfile

    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        script, result = os.path.join(tmp, "worker.py"), os.path.join(tmp, "out.json")
        with open(script, "w") as f:
            f.write(source)
        env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
               "PYTHONWARNINGS": "ignore::FutureWarning", "PYTHONPATH": root,
               "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", os.path.join(root, ".torch_ext"))}
        env.pop("TRITON_INTERPRET", None)
        proc = subprocess.run([sys.executable, script, result, here], env=env, capture_output=True, text=True,
                              timeout=timeout)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        with open(result) as f:
            return json.load(f)
