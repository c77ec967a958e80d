"""One real SFT step (``StageJob.train_step``) on a FIXED global batch of the job's rows, so that runs with other
world sizes or micro-batch splits can be compared. Run as a script by test_sft_runs.py (1 rank, or 2 under torchrun):

    python sft_probe.py <result.pt> key.sub=value ...

Rank r takes rows [r*n, (r+1)*n) of the first 8 rows. Rank 0 writes {"metrics": the step's metrics, "actor":
{name: the full (gathered) parameter after the step minus before it}}.
"""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "trainer"))
from update_probe import gathered  # noqa: E402 (the RL probe's: every parameter gathered from its ZeRO-3 shards)


def main(result_path: str, overrides: list) -> None:
    from verl_ds import dist as vdist
    from verl_ds.config import load_config
    from verl_ds.dist import detect_launch
    from verl_ds.stages.sft import SFTJob

    job = SFTJob(load_config(None, overrides), detect_launch())
    before = gathered(job.engine.module)
    n = 8 // job.world
    metrics = job.train_step([job.train_set[i] for i in range(job.rank * n, (job.rank + 1) * n)])
    after = gathered(job.engine.module)
    if job.rank == 0:
        torch.save({"metrics": metrics, "actor": {k: after[k] - before[k] for k in before}}, result_path)
    job.close()
    vdist.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
