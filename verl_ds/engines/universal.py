"""Resume a ZeRO-1/2/3 checkpoint at another world size via DeepSpeed's universal checkpoint format
(https://www.deepspeed.ai/tutorials/universal-checkpointing/); stage 0 states load at any world size as they are.
Rank 0 converts into ``<engine dir>/universal``, marked complete by a file written last (a killed conversion is
redone); the engine's ``load_universal_checkpoint`` switch is on for that one load only.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import shutil

log = logging.getLogger(__name__)

DONE = "CONVERTED"


def client_state() -> dict:
    """What ``save_checkpoint`` must record for a ZeRO-1/2 checkpoint to be convertible (data parallelism only:
    no tensor or pipeline slices to describe); ZeRO-3 conversion does not read it."""
    from deepspeed.checkpoint.constants import (UNIVERSAL_CHECKPOINT_INFO, UNIVERSAL_CHECKPOINT_VERSION_KEY,
                                                UNIVERSAL_CHECKPOINT_VERSION_VALUE)

    return {UNIVERSAL_CHECKPOINT_INFO: {UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE}}


def convert(src_tag_dir: str, dst_tag_dir: str) -> str:
    """Convert ``src_tag_dir`` to the universal format in ``dst_tag_dir`` unless done already (rank 0 calls this)."""
    if os.path.isfile(os.path.join(dst_tag_dir, DONE)):
        return dst_tag_dir
    from deepspeed.checkpoint import ds_to_universal

    if os.path.isdir(dst_tag_dir):
        shutil.rmtree(dst_tag_dir)  # a conversion that was killed half-way
    args = argparse.Namespace(input_folder=src_tag_dir, output_folder=dst_tag_dir, num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=False)
    chatter = io.StringIO()
    with contextlib.redirect_stdout(chatter), contextlib.redirect_stderr(chatter):  # prints and progress bars
        ds_to_universal.main(args)
    log.debug("ds_to_universal %s:\n%s", src_tag_dir, chatter.getvalue())
    with open(os.path.join(dst_tag_dir, DONE), "w", encoding="utf-8") as fh:
        fh.write("ok\n")
    return dst_tag_dir


def load_universal(engine, universal_dir: str, tag: str):
    """``engine.load_checkpoint`` of a universal checkpoint (weights and optimizer); returns its result."""
    config = engine._config  # DeepSpeed reads this switch at load time only; restore it after
    before = config.load_universal_checkpoint
    config.load_universal_checkpoint = True
    try:
        return engine.load_checkpoint(universal_dir, tag=tag, load_optimizer_states=True,
                                      load_lr_scheduler_states=True)
    finally:
        config.load_universal_checkpoint = before
