"""The layout of a ``verl_ds.batch.RolloutBatch`` (verl's) every model and loss relies on, and the check that a batch
follows it. B = batch, P = prompt width, R = response width, T = P + R: ``observation`` (B, T) is the prompt left-padded
to P then the response right-padded to R; masks come from the lengths, never from ``token != pad`` (pad may be EOS).
Every field's shape, dtype and meaning, and the aliases: docs/batch.md."""
from __future__ import annotations

import difflib
from typing import Iterable

import torch

# The design's 12 fields (under our names) plus what critic-free RL and the trainer add.
DESIGN_FIELDS = ("observation", "action", "old_log_probs", "values", "token_rewards", "next_observation", "done",
                 "advantages", "returns", "mask", "prompt_length", "response_length")
EXTRA_FIELDS = ("ref_log_probs", "response_mask", "scores", "rollout_log_probs", "group_index")
FIELDS = DESIGN_FIELDS + EXTRA_FIELDS
# What generation alone produces (RolloutBatch.from_generation fills these).
ROLLOUT_FIELDS = ("observation", "action", "mask", "response_mask", "prompt_length", "response_length", "done",
                  "next_observation")
# Every field a loss reads, for PPO with a critic (critic-free runs drop "values" and "returns").
REQUIRED_FOR_LOSS = DESIGN_FIELDS + ("response_mask",)

# field -> (dims, dtype); dims use the layout letters above
_SPEC: dict[str, tuple[tuple[str, ...], torch.dtype]] = {
    "observation": (("B", "T"), torch.int64),
    "next_observation": (("B", "T"), torch.int64),
    "mask": (("B", "T"), torch.bool),
    "action": (("B", "R"), torch.int64),
    "response_mask": (("B", "R"), torch.bool),
    "prompt_length": (("B",), torch.int64),
    "response_length": (("B",), torch.int64),
    "done": (("B",), torch.bool),
    "group_index": (("B",), torch.int64),
    **{f: (("B", "R"), torch.float32) for f in
       ("rollout_log_probs", "old_log_probs", "ref_log_probs", "values", "scores", "token_rewards", "advantages",
        "returns")},
}
FLOAT_FIELDS = tuple(f for f, (_, dt) in _SPEC.items() if dt == torch.float32)
FIELD_ALIASES = {"logprob": "old_log_probs", "ref_logprob": "ref_log_probs", "value": "values", "old_value": "values",
                 "score": "scores", "reward": "token_rewards", "advantage": "advantages", "return": "returns"}


class BatchValidationError(ValueError):
    """A RolloutBatch field is missing or malformed; ``field`` names it."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"RolloutBatch.{field}: {message}")


def close_hint(name: str) -> str:
    """"; did you mean ...?" naming the fields (or aliases) close to an unknown ``name``, or ""."""
    close = difflib.get_close_matches(name, FIELDS + tuple(FIELD_ALIASES), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def canonical(name: str) -> str:
    """The field an alias or a name stands for; AttributeError naming close matches for an unknown one."""
    name = FIELD_ALIASES.get(name, name)
    if name not in FIELDS:
        raise AttributeError(f"RolloutBatch has no field {name!r}{close_hint(name)} Fields: {list(FIELDS)} "
                             "(per-sample non-tensor data goes in batch.extras)")
    return name


def check_layout(batch, pad_token_id: int, required: Iterable[str] = REQUIRED_FOR_LOSS) -> None:
    """``RolloutBatch.validate``: presence, shapes, dtypes, masks, finiteness and padding of every field set; the first
    problem raises BatchValidationError naming the field, what was expected and what was found."""
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise TypeError(f"validate: pad_token_id must be an int, got {pad_token_id!r}")
    for f in required:
        f = canonical(f)
        if batch[f] is None:
            dims, dt = _SPEC[f]
            raise BatchValidationError(f, f"missing: expected a ({', '.join(dims)}) {_dt(dt)} tensor, found None")
    present = batch.present()
    if not present:
        raise BatchValidationError("observation", "the batch is empty: no field is set")
    sizes: dict[str, tuple[int, str]] = {}  # letter -> (size, field it came from)
    for f in present:
        t = batch[f]
        dims, dt = _SPEC[f]
        if t.dim() != len(dims):
            raise BatchValidationError(f, f"expected {len(dims)}-D ({', '.join(dims)}), found shape {tuple(t.shape)}")
        if t.dtype != dt:
            hint = " (use a bool mask, not 0/1 ints)" if dt == torch.bool else ""
            raise BatchValidationError(f, f"expected dtype {_dt(dt)}, found {_dt(t.dtype)}{hint}")
        for letter, n in zip(dims, t.shape):
            if letter in sizes and sizes[letter][0] != n:
                raise BatchValidationError(
                    f, f"expected {letter} = {sizes[letter][0]} (from {sizes[letter][1]}), found shape "
                       f"{tuple(t.shape)}")
            sizes.setdefault(letter, (n, f))
    for k, v in batch.extras.items():
        if "B" in sizes and (not hasattr(v, "__len__") or len(v) != sizes["B"][0]):
            raise BatchValidationError(f"extras[{k!r}]", f"expected a per-sample sequence of length "
                                       f"B = {sizes['B'][0]}, found {type(v).__name__} of length "
                                       f"{len(v) if hasattr(v, '__len__') else 'n/a'}")
    for f in FLOAT_FIELDS:
        t = batch[f]
        if t is not None and not bool(torch.isfinite(t).all()):
            bad = (~torch.isfinite(t)).nonzero()[0].tolist()
            raise BatchValidationError(f, f"expected finite float32 values, found {t[tuple(bad)].item()} at "
                                          f"index {tuple(bad)}")
    _check_layout(batch, pad_token_id, sizes)


def _check_layout(batch, pad_token_id: int, sizes: dict) -> None:
    d = {f: batch[f] for f in FIELDS}
    if "T" in sizes and "R" in sizes and sizes["R"][0] >= sizes["T"][0]:
        raise BatchValidationError(sizes["R"][1], f"expected response width R < T = {sizes['T'][0]} (the "
                                                  f"prompt needs at least one column), found R = {sizes['R'][0]}")
    R = sizes["R"][0] if "R" in sizes else None
    T = sizes["T"][0] if "T" in sizes else None
    P = T - R if (T is not None and R is not None) else None
    for f, letter, width in (("response_length", "R", R), ("prompt_length", "P", P)):
        n = d[f]
        if n is not None and width is not None and bool(((n < 1) | (n > width)).any()):
            i = int(((n < 1) | (n > width)).nonzero()[0])
            raise BatchValidationError(f, f"expected values in [1, {letter}={width}], found {int(n[i])} at row {i}")
    span = None  # (B, R): the first response_length columns of each row
    if d["response_length"] is not None and R is not None:
        span = torch.arange(R, device=d["response_length"].device).unsqueeze(0) < d["response_length"].unsqueeze(1)
    if d["response_mask"] is not None and span is not None:
        # environment tokens of a multi-turn trajectory are the holes (attended, not trained)
        outside = d["response_mask"] & ~span.to(d["response_mask"].device)
        _expect_equal("response_mask", d["response_mask"] & ~outside, d["response_mask"],
                      "False past the first response_length columns of each row")
    if d["mask"] is not None and P is not None:
        if span is not None:
            _expect_equal("mask", d["mask"][:, P:], span.to(d["mask"].device),
                          "mask[:, P:] True exactly on the first response_length columns")
        if d["response_mask"] is not None:
            _expect_equal("response_mask", d["response_mask"], d["response_mask"] & d["mask"][:, P:],
                          "response_mask only where mask[:, P:] is True")
        if d["prompt_length"] is not None:
            want = torch.arange(P, device=d["mask"].device).unsqueeze(0) >= (P - d["prompt_length"]).unsqueeze(1)
            _expect_equal("mask", d["mask"][:, :P], want, "the prompt part True on the last prompt_length "
                                                          "columns (left padding)")
    if d["mask"] is not None and d["observation"] is not None:
        obs = d["observation"]
        bad = (~d["mask"]) & (obs != pad_token_id)
        if bool(bad.any()):
            i, j = bad.nonzero()[0].tolist()
            raise BatchValidationError("observation", f"expected pad_token_id {pad_token_id} wherever mask is "
                                                      f"False, found {int(obs[i, j])} at ({i}, {j})")
    if d["action"] is not None and d["observation"] is not None and P is not None:
        _expect_equal("action", d["action"], d["observation"][:, P:], "action == observation[:, P:] (the "
                                                                      "last R columns)")


def _dt(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _expect_equal(field: str, found: torch.Tensor, want: torch.Tensor, rule: str) -> None:
    want = want.to(found.dtype)
    if not torch.equal(found, want):
        diff = found != want
        i, j = diff.nonzero()[0].tolist()
        raise BatchValidationError(field, f"expected {rule}; found a mismatch at ({i}, {j}): expected "
                                          f"{want[i, j].item()}, found {found[i, j].item()} "
                                          f"({int(diff.any(-1).sum())} row(s) differ)")
