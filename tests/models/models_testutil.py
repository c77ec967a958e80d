"""Shared helpers for the Models tests (a plain module: conftest.py names clash across test folders)."""
import functools

import torch

PAD, BOS, EOS, VOCAB = 0, 1, 2, 50


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS,
              max_position_embeddings=64)
    kw.update(overrides)
    return LlamaConfig(**kw)


def make_rollout_batch(B=4, P=5, R=4, seed=0, eos_rows=(0,)):
    """A RolloutBatch with left-padded prompts and random responses; rows in eos_rows end with EOS early."""
    from verl_ds.batch import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, P + 1, (B,), generator=g)
    prompt_len[-1] = P
    prompt_mask = torch.arange(P).unsqueeze(0) >= (P - prompt_len).unsqueeze(1)
    prompt_ids = torch.where(prompt_mask, torch.randint(3, VOCAB, (B, P), generator=g), torch.full((B, P), PAD))
    responses = torch.randint(3, VOCAB, (B, R), generator=g)
    for i in eos_rows:
        responses[i, R // 2] = EOS
    return RolloutBatch.from_generation(prompt_ids, prompt_mask, responses, pad_token_id=PAD, eos_token_id=EOS,
                                        extras={"prompt": [f"prompt {i}" for i in range(B)]})


# ---- hand-controlled components: every expected number in the tests is computed by hand from their tables -----

FLOOR = -1e4  # logit of an "impossible" token: exp(FLOOR - logsumexp) is exactly 0 in float32 and float64


def bigram_table(rows: dict, vocab: int = VOCAB) -> torch.Tensor:
    """(V, V) logits: row a holds log(weight) for the tokens listed in ``rows[a]`` ({token: weight}), FLOOR
    elsewhere; a row not listed is uniform. So p(b | a) = weight_b / sum of the row's weights, exactly."""
    import math

    table = torch.zeros(vocab, vocab)
    for a, weights in rows.items():
        table[a] = FLOOR
        for b, w in weights.items():
            table[a, b] = math.log(w)
    return table


@functools.lru_cache(maxsize=None)
def _bigram_classes():
    from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutputWithPast

    class BigramConfig(PretrainedConfig):
        model_type = "verl_ds_test_bigram"

        def __init__(self, vocab_size=VOCAB, **kwargs):
            self.vocab_size = vocab_size
            self.num_hidden_layers = 1  # HF's generation cache reads it
            super().__init__(**kwargs)

    class BigramLM(PreTrainedModel, GenerationMixin):
        """A causal LM whose logits at position t are ``table[input_ids[t]]`` (depends on the current token only),
        so it works with HF generate (with or without a cache) and every probability is known by hand."""

        config_class = BigramConfig

        def __init__(self, config, table: torch.Tensor):
            super().__init__(config)
            self.table = torch.nn.Parameter(table.clone().float())

        def forward(self, input_ids=None, attention_mask=None, position_ids=None, logits_to_keep=0, **kwargs):
            logits = self.table[input_ids]  # (B, T, V)
            if logits_to_keep:
                logits = logits[:, -logits_to_keep:]
            return CausalLMOutputWithPast(logits=logits)

    return BigramConfig, BigramLM


def make_bigram_lm(rows: dict, vocab: int = VOCAB):
    """A BigramLM (a real HF PreTrainedModel with GenerationMixin) over ``bigram_table(rows)``."""
    config_cls, lm_cls = _bigram_classes()
    cfg = config_cls(vocab_size=vocab, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS)
    return lm_cls(cfg, bigram_table(rows, vocab)).eval()


class PlainBigram(torch.nn.Module):
    """The same bigram logits from a plain nn.Module without ``logits_to_keep`` (every position comes back)."""

    def __init__(self, table: torch.Tensor):
        super().__init__()
        self.table = torch.nn.Parameter(table.clone().float())

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.table[input_ids]


class TokenValueNet(torch.nn.Module):
    """A critic whose value at position t is ``table[input_ids[t]]``: (B, T) values known by hand."""

    def __init__(self, values: dict, vocab: int = VOCAB):
        super().__init__()
        table = torch.zeros(vocab)
        for token, v in values.items():
            table[token] = v
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.table[input_ids]


class TokenScorer(torch.nn.Module):
    """A reward scorer returning per-token scores ``table[input_ids]`` (B, T); records each forward's batch size."""

    def __init__(self, scores: dict, vocab: int = VOCAB):
        super().__init__()
        table = torch.zeros(vocab)
        for token, s in scores.items():
            table[token] = s
        self.register_buffer("table", table)
        self.batch_sizes = []

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        self.batch_sizes.append(int(input_ids.shape[0]))
        return self.table[input_ids]
