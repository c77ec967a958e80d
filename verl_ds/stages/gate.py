"""The start-up gate of a supervised-style job (``verl-ds sft|rm|dpo``): the job's own config checks
(``check_stage_config``) and the machine checks any job needs (``check_common``), on the config as given. A key of
the RL job that these jobs once read under another meaning is refused naming the job's own key; the other keys of the
RL job (or of another stage) are not read, and setting one is warned about (docs/stages.md, "Keys")."""
from __future__ import annotations

import sys
from typing import Optional

from verl_ds.config import Config, ConfigError, Derived, iter_fields
from verl_ds.run.checks import check_stage_config
from verl_ds.run.startup import check_common

JOB_NAMES = {"sft": "SFT", "rm": "reward-model", "dpo": "DPO"}
# the sections every supervised job reads; besides them, each reads its own (sft, rm, dpo)
COMMON_SECTIONS = ("model", "data", "actor", "deepspeed", "trainer")
_warned: set = set()  # the CLI's gate and the job's own run the same checks: one warning per message


def completion_key(job: str) -> str:
    """The key that limits ``job``'s completion tokens (these jobs once borrowed the RL sampler's
    ``rollout.max_new_tokens``)."""
    return f"{job}.max_completion_length"


def unread_keys(cfg: Config, job: str) -> dict:
    """key -> value of each key ``cfg`` sets away from its default that ``job`` does not read."""
    default, out = Config(), {}
    for dotted, _, _, _ in iter_fields():
        section, name = dotted.split(".")
        value = getattr(getattr(cfg, section), name)
        if section not in COMMON_SECTIONS and section != job and value != getattr(getattr(default, section), name):
            out[dotted] = value
    return out


def check_stage(cfg: Config, world_size: int = 1, rank: int = 0, job: Optional[str] = None) -> Derived:
    """Refuse a bad supervised job before anything is built (ConfigError naming the key); returns the sizes the
    engines need. ``job`` (sft, rm, dpo) adds the checks of its own keys: its completion limit within the model's
    context, a borrowed RL key refused naming the job's, unread keys warned about (rank 0). ``cfg`` is not changed."""
    if job is not None and job not in JOB_NAMES:
        raise ValueError(f"check_stage: job must be one of {list(JOB_NAMES)} or None, got {job!r}")
    unread = unread_keys(cfg, job) if job is not None else {}
    if "rollout.max_new_tokens" in unread:  # a config of the days when it was: refused, its meaning changed
        new, value = completion_key(job), unread["rollout.max_new_tokens"]
        raise ConfigError(f"rollout.max_new_tokens={value}: rollout.max_new_tokens is the RL sampler's limit; the "
                          f"{JOB_NAMES[job]} job's completion limit is {new} (set {new}={value} instead)")
    derived = check_stage_config(cfg, world_size, None if job is None else completion_key(job))
    if unread and rank == 0:
        message = (f"verl_ds: warning: verl-ds {job} does not read {', '.join(unread)} (keys of the RL job or of "
                   f"another stage): they have no effect on this job")
        if message not in _warned:
            _warned.add(message)
            print(message, file=sys.stderr, flush=True)
    check_common(cfg)
    return derived

