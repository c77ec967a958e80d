"""A family with its own attention code (Bloom: ALiBi, no transformers AttentionInterface dispatch) cannot be packed;
the run falls back to padded batches with a log line, as docs/models.md says, instead of failing at start-up, and its
padded log-probs equal each sequence run alone."""
import os

import pytest
import torch

from e2e_utils import read_metrics, run_train

pytestmark = pytest.mark.slow  # a real training run


def _tiny_bloom(path) -> str:
    from transformers import BloomConfig, BloomForCausalLM

    from verl_ds.tokenizer import build_tokenizer

    tok = build_tokenizer()
    cfg = BloomConfig(vocab_size=len(tok), hidden_size=32, n_layer=2, n_head=4, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    BloomForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_bloom_runs_on_padded_batches(tmp_path):
    model = _tiny_bloom(tmp_path / "bloom")
    out = str(tmp_path / "run")
    proc = run_train(out, [f"model.path={model}", "trainer.export=none"], timeout=600)
    log = proc.stdout + proc.stderr
    assert "cannot be packed" in log and "padded batches are used" in log, log[-3000:]
    assert "keeps its own attention on padded batches" in log, log[-3000:]
    steps = [m for m in read_metrics(out) if "rollout/score/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]


def test_bloom_padded_log_probs_equal_each_sequence_alone():
    """What the fallback relies on: Bloom's ALiBi reads the padding mask, so a left-padded row scores as alone (float32,
    the trainer's dtype: in float64 transformers' Bloom turns padded rows into NaN)."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    lm = BloomForCausalLM(BloomConfig(vocab_size=50, hidden_size=32, n_layer=2, n_head=4)).eval()
    seqs = [torch.randint(1, 50, (n,)) for n in (7, 3, 5)]
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):  # left padding, as the rollout's prompts
        ids[i, width - len(s):], mask[i, width - len(s):] = s, 1
    with torch.no_grad():
        batched = lm(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)
        for i, s in enumerate(seqs):
            alone = lm(input_ids=s[None]).logits.log_softmax(-1)[0]
            torch.testing.assert_close(batched[i, width - len(s):], alone, rtol=0, atol=1e-5)
