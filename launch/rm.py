#!/usr/bin/env python
"""The rm job (verl_ds.stages.rm) under any launcher, as launch/train.py runs the RL job:

    python launch/rm.py --config configs/rm.yaml key=value ...
    torchrun --nproc_per_node 2 launch/rm.py ...
    deepspeed --num_gpus 2 launch/rm.py ...
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml launch/rm.py ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ds.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["rm", *sys.argv[1:]]))
