"""Log-probs (and entropy) of the response tokens read in place from a causal LM's (B, R+1, V) logits: slicing
``logits[:, :-1]`` would copy the block (about 20 GB at 65536 tokens x 152064 bf16) and keep it for the backward.
The last position of each sample gets ``ignore_index``: the kernel streams no column for it and returns 0.
"""
from __future__ import annotations

import torch

from verl_ds.kernels import dispatch

from .logprob import logprobs_and_entropy, logprobs_from_logits

IGNORE_INDEX = -100


def _check(logits, labels) -> None:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3:
        got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ValueError(f"logits must be (B, R+1, V): the last R+1 positions of a causal LM's output, got {got}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a float tensor, got {logits.dtype}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 2:
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"labels must be (B, R) response token ids, got {got}")
    B, T, V = logits.shape
    if labels.shape != (B, T - 1):
        raise ValueError(f"labels must have shape (B, R) = ({B}, {T - 1}) for logits of shape {tuple(logits.shape)} "
                         f"(R+1 positions predict R tokens), got {tuple(labels.shape)}")
    if labels.dtype == torch.bool or labels.is_floating_point() or labels.is_complex():
        raise TypeError(f"labels must be an integer (int64) tensor of token ids, got {labels.dtype}")
    if labels.device != logits.device:
        raise ValueError(f"labels is on {labels.device} but logits is on {logits.device}")


def response_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0,
                      compute_entropy: bool = False):
    """(log_probs (B, R) float32, entropy (B, R) float32 or None) of ``labels`` (B, R) under softmax(logits / t)
    of the last R+1 positions (B, R+1, V) of the model output, differentiable, with no copy of the logits."""
    _check(logits, labels)
    use_triton = logits.dtype != torch.float64 and dispatch.backend_for(logits) == "triton"
    if not use_triton:
        if compute_entropy:
            return logprobs_and_entropy(logits[:, :-1], labels, temperature)
        return logprobs_from_logits(logits[:, :-1], labels, temperature), None
    from verl_ds.kernels.logprob import logprobs_and_entropy as kernel  # local: needs triton

    B, T, V = logits.shape
    labels = labels.to(torch.int64)
    if labels.numel():
        lo, hi = int(labels.min()), int(labels.max())  # an ignore_index among the labels would pass silently
        if lo < 0 or hi >= V:
            raise ValueError(f"labels must be token ids in [0, V) = [0, {V}), got {lo if lo < 0 else hi}")
    padded = torch.full((B, T), IGNORE_INDEX, dtype=torch.int64, device=labels.device)
    padded[:, :-1] = labels
    if logits.stride(2) == 1 and logits.stride(0) == T * logits.stride(1):
        # the usual case (a model output, or a slice of the batch dim): the rows of all samples are one strided view
        rows = logits.view(B * T, V)
        lp, ent = kernel(rows, padded.view(-1), temperature, compute_entropy=compute_entropy, ignore_index=IGNORE_INDEX)
        lp, ent = lp.view(B, T), (ent.view(B, T) if ent is not None else None)
    else:
        # a slice along positions (logits[:, -R-1:] of a longer output): each sample's rows are a view (unbind:
        # its backward stacks the per-sample gradients into one tensor)
        outs = [kernel(rows, padded[b], temperature, compute_entropy=compute_entropy, ignore_index=IGNORE_INDEX)
                for b, rows in enumerate(logits.unbind(0))]
        lp = torch.stack([o[0] for o in outs])
        ent = torch.stack([o[1] for o in outs]) if compute_entropy else None
    return lp[:, :-1], (ent[:, :-1] if ent is not None else None)
