#!/bin/bash
# One node of a verl_ds job under the `deepspeed` launcher: what `srun` starts once per node in
# slurm/train_deepspeed.sbatch. `deepspeed --no_ssh --node_rank=$SLURM_NODEID` starts this node's ranks
# from the shared hostfile (no pdsh, no ssh between nodes); each rank gets RANK/LOCAL_RANK and --local_rank.
# Runnable without Slurm: SLURM_NODEID=0 HOSTFILE=<file with "localhost slots=2"> MASTER_ADDR=127.0.0.1 \
#   MASTER_PORT=29533 REPO_DIR=$PWD CONFIG=configs/default.yaml OUTPUT_DIR=runs/x slurm/deepspeed_node.sh
# Parameters (environment, set by the sbatch script): REPO_DIR, VENV, CONFIG, OUTPUT_DIR, HOSTFILE,
# MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE, TRAIN_SCRIPT (default launch/train.py); the arguments are config
# overrides (key.sub=value).
#
# Signals: the deepspeed launcher's own processes die on USR1 and answer TERM by terminating the ranks
# (SIGKILL 30 s later, exit status 1). So USR1 and TERM that reach this script are passed to the rank
# processes only, as USR1: they checkpoint and exit 75, which the launcher passes back up as its status.
set -uo pipefail
cd "${REPO_DIR:?REPO_DIR: the verl_ds checkout to run from}" || exit 1
if [ -n "${VENV:-}" ] && [ -f "$VENV/bin/activate" ]; then
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
fi
unset RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE
: "${SLURM_NODEID:?SLURM_NODEID is not set: run this under srun (or set it by hand)}"
: "${HOSTFILE:?HOSTFILE: the DeepSpeed hostfile (one '<host> slots=N' line per node)}"
: "${MASTER_ADDR:?MASTER_ADDR: the first node of the hostfile}"
GPUS_PER_NODE=${GPUS_PER_NODE:-$(awk 'NR == 1 { sub("slots=", "", $2); print $2 }' "$HOSTFILE")}
# the deepspeed launcher leaves OMP_NUM_THREADS unset: every rank would use all cores of the node
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} / GPUS_PER_NODE > 0 ? ${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} / GPUS_PER_NODE : 1 ))}

# runner -> deepspeed.launcher.launch -> ranks: the ranks are the runner's grandchildren
ranks() { local p; for p in $(ps -o pid= --ppid "$1"); do ps -o pid= --ppid "$p"; done; }
to_ranks() { echo "[verl_ds deepspeed_node] $1 received: USR1 to the ranks" >&2; kill -USR1 $(ranks "$runner") 2>/dev/null; }
trap 'signalled=1; to_ranks USR1' USR1
trap 'signalled=1; to_ranks TERM' TERM
signalled=0

deepspeed --hostfile "$HOSTFILE" --no_ssh --node_rank="$SLURM_NODEID" \
    --num_gpus="$GPUS_PER_NODE" --master_addr="$MASTER_ADDR" --master_port="${MASTER_PORT:?MASTER_PORT}" \
    "${TRAIN_SCRIPT:-launch/train.py}" --config "${CONFIG:?CONFIG: the job config}" trainer.output_dir="${OUTPUT_DIR:?OUTPUT_DIR}" "$@" &
runner=$!
while :; do
    wait "$runner"; rc=$?
    if [ "$signalled" = 1 ] && [ "$rc" -gt 128 ]; then signalled=0; continue; fi
    break
done
exit "$rc"
