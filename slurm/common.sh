# Shell helpers shared by slurm/*.sbatch (sourced, not run). Kept apart from the sbatch scripts so the
# tests can run them without Slurm: node-list expansion, the DeepSpeed hostfile, and the step runner that
# forwards the preemption signal and requeues the job when the trainer exits with PREEMPT_EXIT_CODE.

# The trainer's "checkpointed after SIGUSR1/SIGTERM, run me again" exit status (EX_TEMPFAIL).
PREEMPT_EXIT_CODE=${PREEMPT_EXIT_CODE:-75}

vds_log() { echo "[verl_ds slurm $(date +%H:%M:%S)] $*" >&2; }

# Host names of the job, one per line: `scontrol show hostnames` where Slurm works, else (no scontrol, or
# one without a slurm.conf to read, which makes it fail) the same expansion as verl_ds.dist.expand_nodelist
# (which the trainer uses for SLURM_NODELIST; tests keep the three equal) in plain Python, without torch.
vds_hosts() {
    local list=${1:-${SLURM_JOB_NODELIST:-${SLURM_NODELIST:-}}} hosts
    if [ -z "$list" ]; then
        vds_log "no node list: SLURM_JOB_NODELIST is not set (run inside an allocation)"
        return 1
    fi
    if command -v scontrol >/dev/null 2>&1 && hosts=$(scontrol show hostnames "$list" 2>/dev/null) \
            && [ -n "$hosts" ]; then
        printf '%s\n' "$hosts"
        return
    fi
    "${PYTHON:-python3}" - "$list" <<'PY'
import re, sys
for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", sys.argv[1]):
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        print(prefix)
        continue
    for part in ranges.split(","):
        lo, _, hi = part.partition("-")
        for i in range(int(lo), int(hi or lo) + 1):
            print(f"{prefix}{i:0{len(lo)}d}")
PY
}

# vds_write_hostfile PATH SLOTS [NODELIST]: a DeepSpeed hostfile ("<host> slots=N" per node).
vds_write_hostfile() {
    local path=$1 slots=$2 hosts
    hosts=$(vds_hosts "${3:-}") || return 1
    printf '%s\n' "$hosts" | awk -v s="$slots" 'NF { print $1 " slots=" s }' > "$path"
}

# vds_job_reason: the Reason field of this job in `scontrol show job` ("TimeLimit" once Slurm ends it at its
# time limit; empty where scontrol cannot say). A function, so tests can define their own.
vds_job_reason() {
    scontrol show job "${SLURM_JOB_ID:-}" --oneliner 2>/dev/null | sed -n 's/.* Reason=\([^ ]*\).*/\1/p'
}

# vds_run_step CMD...: run CMD in the background and wait for it. USR1 (sent by `#SBATCH --signal=B:USR1@T`
# before the time limit, or by `scancel --batch --signal=USR1`) and TERM (Slurm ending the job: scancel,
# preemption, the time limit) are forwarded to it, so the trainer can checkpoint. When CMD exits with
# PREEMPT_EXIT_CODE the job is requeued with REQUEUE_CMD (default: scontrol requeue <job id>), at most
# MAX_REQUEUES times, except after a TERM that was not the time limit: Slurm then ends the job on purpose
# (scontrol requeue would bring back even a cancelled job), and a job preempted with PreemptMode=REQUEUE
# is requeued by Slurm itself. Returns CMD's exit status.
vds_run_step() {
    local pid rc signalled=0 term=0
    trap 'signalled=1; vds_log "USR1 received: asking the trainer to checkpoint and stop"; kill -USR1 "$pid" 2>/dev/null' USR1
    trap 'signalled=1; term=1; vds_log "TERM received: forwarding to the trainer"; kill -TERM "$pid" 2>/dev/null' TERM
    "$@" &
    pid=$!
    while :; do
        wait "$pid"
        rc=$?
        # a trapped signal makes `wait` return early (status > 128) while the step still runs: wait again
        # (bash keeps a finished job's status, so the second wait returns it even when the step has ended)
        if [ "$signalled" = 1 ] && [ "$rc" -gt 128 ]; then
            signalled=0
            continue
        fi
        break
    done
    trap - USR1 TERM
    if [ "$rc" -eq "$PREEMPT_EXIT_CODE" ]; then
        local count=${SLURM_RESTART_COUNT:-0} max=${MAX_REQUEUES:-20} reason=
        [ "$term" = 1 ] && reason=$(vds_job_reason)
        if [ "$term" = 1 ] && [ "$reason" != TimeLimit ]; then
            vds_log "trainer checkpointed (exit $rc) after Slurm's TERM (scancel or preemption): not requeueing;" \
                    "sbatch again to continue from the checkpoint"
        elif [ "$count" -ge "$max" ]; then
            vds_log "trainer checkpointed (exit $rc) but the job was already requeued $count times (MAX_REQUEUES=$max): not requeueing"
        else
            vds_log "trainer checkpointed and exited $rc: requeueing job ${SLURM_JOB_ID:-?} (restart $((count + 1)))"
            eval "${REQUEUE_CMD:-scontrol requeue ${SLURM_JOB_ID:?SLURM_JOB_ID is not set}}" \
                || vds_log "requeue failed: resubmit by hand; trainer.resume=auto continues from the checkpoint"
        fi
    elif [ "$rc" -ne 0 ]; then
        vds_log "training step failed with exit status $rc"
    fi
    return "$rc"
}
