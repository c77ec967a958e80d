#!/usr/bin/env python
"""Train a causal LM with PPO on DeepSpeed ZeRO-3 engines.

    python launch/train.py                                   # the small default job, CPU, world size 1
    python launch/train.py --config configs/default.yaml trainer.total_steps=50 actor.lr=1e-3
    torchrun --nproc_per_node 2 launch/train.py --config configs/default.yaml
    deepspeed --num_gpus 2 --master_port 29611 launch/train.py --config configs/default.yaml
    accelerate launch --config_file configs/accelerate/deepspeed_zero3.yaml launch/train.py --config ...
    sbatch slurm/train.sbatch                                # srun, one task per GPU

Rank, world size and master address are read from whichever launcher started the process.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from verl_ds.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
