#!/bin/bash
# One rank of a verl_ds job: what `srun` starts once per GPU in slurm/train.sbatch.
# The trainer reads its rank from SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS and SLURM_NODELIST (the first
# node is the master; MASTER_ADDR/MASTER_PORT from the batch script win) and exports the torch variables
# itself, which DeepSpeed needs (it ignores SLURM_*). Runnable without Slurm by setting those variables:
#   SLURM_PROCID=1 SLURM_LOCALID=1 SLURM_NTASKS=2 SLURM_NODELIST=localhost MASTER_PORT=29533 \
#   REPO_DIR=$PWD CONFIG=configs/default.yaml OUTPUT_DIR=runs/x slurm/task.sh trainer.total_steps=2
# Parameters (environment, set by the sbatch script): REPO_DIR, VENV, CONFIG, OUTPUT_DIR, PYTHON, TRAIN_SCRIPT
# (default launch/train.py; launch/sft.py, rm.py, dpo.py run the other jobs: docs/stages.md); the script's
# arguments are config overrides (key.sub=value).
set -euo pipefail
cd "${REPO_DIR:?REPO_DIR: the verl_ds checkout to run from}"
if [ -n "${VENV:-}" ] && [ -f "$VENV/bin/activate" ]; then
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
fi
# a RANK/WORLD_SIZE inherited from the submitting shell would override Slurm's view of this task
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
: "${SLURM_PROCID:?SLURM_PROCID is not set: run this under srun (or set the SLURM_* variables by hand)}"
# one rank per GPU shares the node's cores: use this task's share
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# exec: the preemption signal that srun forwards reaches the trainer itself, not this shell
exec "${PYTHON:-python}" "${TRAIN_SCRIPT:-launch/train.py}" --config "${CONFIG:?CONFIG: the job config}" \
    trainer.output_dir="${OUTPUT_DIR:?OUTPUT_DIR: the run directory}" "$@"
