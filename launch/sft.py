#!/usr/bin/env python
"""The sft job (verl_ds.stages.sft) under any launcher, as launch/train.py runs the RL job:

    python launch/sft.py --config configs/sft.yaml key=value ...
    torchrun --nproc_per_node 2 launch/sft.py ...
    deepspeed --num_gpus 2 launch/sft.py ...
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml launch/sft.py ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ds.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["sft", *sys.argv[1:]]))
