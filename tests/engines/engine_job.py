"""The small job the engine tests' workers train (the workers import it: ``dist_testutil`` puts this folder on their
path): four parity sequences of the built-in tokenizer as a causal-LM batch, two optimizer steps of two accumulated
micro-batches of two rows."""
ROWS = ["even : 3 8 1 => 8", "odd : 5 2 => 5", "even : 4 4 => 4", "odd : 1 => 1"]
BASE = ["rollout.batch_size=4", "actor.mini_batch_size=4", "actor.micro_batch_size=2", "trainer.device=cpu"]
_tokenizers: list = []


def setup(extra=(), world: int = 1) -> tuple:
    """(cfg, derived, tokenizer, encoding, labels) of the default tiny job with BASE and ``extra`` overrides, for
    ``world`` ranks; the tokenizer is built once per process."""
    from verl_ds.config import load_config, validate
    from verl_ds.engines.build import load_tokenizer

    given = {o.split("=", 1)[0] for o in extra}  # a key given twice is refused: extra replaces BASE's
    cfg = load_config(None, [o for o in BASE if o.split("=", 1)[0] not in given] + list(extra))
    derived = validate(cfg, world)
    if not _tokenizers:
        _tokenizers.append(load_tokenizer(cfg))
    tok = _tokenizers[0]
    return (cfg, derived, tok, *parity_batch(tok))


def parity_batch(tok) -> tuple:
    """(the tokenizer's padded encoding of ROWS, labels: the input ids with padding set to -100)."""
    enc = tok(ROWS, return_tensors="pt", padding=True)
    return enc, enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)


def train_two_steps(engine, enc, labels, after_backward=None) -> None:
    """Two optimizer steps of two accumulated micro-batches (rows 0-1, then 2-3) of a DeepSpeed engine's LM loss;
    ``after_backward(step, rows)`` runs after each backward, before the engine's step."""
    for step in range(2):
        for rows in ([0, 1], [2, 3]):
            loss = engine(input_ids=enc["input_ids"][rows], attention_mask=enc["attention_mask"][rows],
                          labels=labels[rows]).loss
            engine.backward(loss)
            if after_backward is not None:
                after_backward(step, rows)
            engine.step()
