#!/usr/bin/env python
"""The dpo job (verl_ds.stages.dpo) under any launcher, as launch/train.py runs the RL job:

    python launch/dpo.py --config configs/dpo.yaml key=value ...
    torchrun --nproc_per_node 2 launch/dpo.py ...
    deepspeed --num_gpus 2 launch/dpo.py ...
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml launch/dpo.py ...
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ds.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["dpo", *sys.argv[1:]]))
