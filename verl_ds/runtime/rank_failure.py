"""A collective that fails because another rank died or went silent becomes a RankFailure saying so."""
from __future__ import annotations

import functools
import re
import sys

import torch

from verl_ds import dist as vdist


class RankFailure(RuntimeError):
    """A collective failed because another rank died or stopped answering; the message says what to do."""


_PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "Timed out", "timed out", "Broken pipe",
                 "NCCL communicator was aborted", "Socket Timeout", "recvBytes", "Connection refused")


def is_peer_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because of another rank (gloo/NCCL errors, their timeouts)."""
    dist_error = getattr(torch.distributed, "DistError", ())
    text = str(exc)
    return bool(dist_error and isinstance(exc, dist_error)) or (
        isinstance(exc, RuntimeError) and any(k in text for k in _PEER_FAILURE)
        and ("gloo" in text or "nccl" in text.lower() or "c10d" in text))


def explains_rank_failures(method):
    """A collective failing because of another rank becomes RankFailure naming the checkpoint to continue from."""

    @functools.wraps(method)
    def wrapper(trainer, *args, **kwargs):
        try:
            return method(trainer, *args, **kwargs)
        except Exception as exc:
            if not is_peer_failure(exc):
                raise
            from verl_ds.checkpoint import find_resumable

            what = re.sub(r"^\[[^\]]*\]\s*", "", str(exc).splitlines()[0]).split(". This is typically")[0][:200]
            msg = (f"rank {vdist.rank()}: a collective failed because another rank died or stopped answering for "
                   f"trainer.dist_timeout_s={trainer.cfg.trainer.dist_timeout_s} s ({what}). The other ranks' logs "
                   f"say why. Last complete checkpoint: "
                   f"{find_resumable(trainer.ckpt_root) or 'none'}; restart the job (trainer.resume=auto continues)")
            print(f"verl_ds: error: {msg}", file=sys.stderr, flush=True)
            raise RankFailure(msg) from exc

    return wrapper


class StepFailed(RuntimeError):
    """A step failed on some rank at a point every rank agrees on (no update was applied after it)."""


def raise_if_any_rank_failed(error, what: str) -> None:
    """Collective: StepFailed on every rank when any has ``error``, so healthy ranks do not hang in a collective."""
    errors = vdist.gather_object(None if error is None else f"{type(error).__name__}: {error}")
    if any(errors):
        raise StepFailed(f"{what}: " + "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e)) from error
