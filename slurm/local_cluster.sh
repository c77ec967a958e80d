#!/bin/bash
# A single-node Slurm on this machine, to try slurm/*.sbatch before a real cluster (and what the tests in
# tests/launch/test_launch_slurm_cluster.py run against). Needs root and Debian's (or Ubuntu's) packages:
#   apt-get install --no-install-recommends slurmctld slurmd slurm-client munge
#
#   slurm/local_cluster.sh up /tmp/vds-slurm      # writes the config, starts munged, slurmctld, slurmd
#   export SLURM_CONF=/tmp/vds-slurm/slurm.conf   # what `up` prints: every client command needs it
#   CONFIG=configs/default.yaml sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 --cpus-per-task=1 \
#       --partition=debug slurm/train.sbatch trainer.total_steps=400 trainer.device=cpu
#   slurm/local_cluster.sh down /tmp/vds-slurm    # cancels its jobs, stops the daemons, deletes the directory
#
# Everything (config, munge key and socket, state, spool, logs, pid files) lives in the one directory, so
# it neither needs nor touches /etc/slurm, /etc/munge or a munged already running. Parameters (environment):
# SLURMCTLD_PORT / SLURMD_PORT (default 6817 / 6818), CPUS (default: what `slurmd -C` finds), NODE_NAME
# (default: `hostname -s`, or localhost when that does not resolve: the trainer's MASTER_ADDR is the first
# node's name),
# CRED_EXPIRE (default 5 s, Slurm's minimum: a requeued job waits CRED_EXPIRE + 1 s before it may start),
# UP_TIMEOUT (default 120 s: how long `up` waits for the node to become idle before giving up).
set -uo pipefail

usage() { echo "usage: $0 up|down|status DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
action=$1
dir=$2
log() { echo "[local_cluster] $*" >&2; }

need() {
    local missing=() bin
    for bin in munged slurmctld slurmd sbatch sinfo scontrol; do
        command -v "$bin" >/dev/null 2>&1 || missing+=("$bin")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        log "not installed: ${missing[*]} (apt-get install --no-install-recommends slurmctld slurmd slurm-client munge)"
        exit 3
    fi
    if [ "$(id -u)" != 0 ]; then
        log "must run as root: slurmd starts jobs as their user and munged/slurmd/slurmctld run as SlurmUser=root"
        exit 3
    fi
}

write_config() {
    local cpus=${CPUS:-$(slurmd -C | sed -n 's/.*CPUs=\([0-9]*\).*/\1/p' | head -n 1)}
    node=${NODE_NAME:-$(hostname -s)}
    if ! getent hosts "$node" >/dev/null; then
        if [ -n "${NODE_NAME:-}" ]; then
            log "NODE_NAME '$node' does not resolve: the trainer connects to the first node by name"
            exit 3
        fi
        log "this host's name '$node' does not resolve: the node is called localhost"
        node=localhost
    fi
    mkdir -p "$dir"/{state,spool,log,munge}
    chmod 700 "$dir/munge"
    # the munge key: 1 KiB of random bytes, readable by root only (munged refuses a looser mode)
    head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    cat > "$dir/slurm.conf" <<EOF
# single-node Slurm for verl_ds (slurm/local_cluster.sh)
ClusterName=verl_ds_local
SlurmctldHost=$(hostname -s)(127.0.0.1)
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire is also how long a requeued job waits before it may start again (+1 s); 5 is the minimum
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=${CRED_EXPIRE:-5}
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# no cgroups: processes tracked by parent id, no task binding
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
# a requeued job starts within a second of its begin time (the defaults scan every 30-60 s)
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
# finished jobs stay visible to scontrol show job for an hour
MinJobAge=3600
ReturnToService=2
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP
EOF
}

pid_of() { [ -s "$1" ] && cat "$1"; }

up() {
    need
    if [ -e "$dir/slurm.conf" ] && [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        log "already up in $dir"
        echo "export SLURM_CONF=$dir/slurm.conf"
        return 0
    fi
    write_config
    export SLURM_CONF=$dir/slurm.conf
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/munged.seed" \
        || { log "munged did not start: $(tail -n 5 "$dir/log/munged.log" 2>/dev/null)"; exit 1; }
    slurmctld -f "$SLURM_CONF" || { log "slurmctld did not start: $(tail -n 5 "$dir/log/slurmctld.log")"; exit 1; }
    slurmd -f "$SLURM_CONF" -N "$node" || { log "slurmd did not start: $(tail -n 5 "$dir/log/slurmd.log")"; exit 1; }
    local deadline=$((SECONDS + ${UP_TIMEOUT:-120})) state=
    while [ $SECONDS -lt "$deadline" ]; do
        state=$(sinfo -h -o %t 2>/dev/null | head -n 1)
        [ "$state" = idle ] && break
        sleep 0.5
    done
    if [ "$state" != idle ]; then
        log "the node is '${state:-unknown}', not idle, after ${UP_TIMEOUT:-120} s; slurmd log:"
        tail -n 20 "$dir/log/slurmd.log" >&2
        log "slurmctld log:"
        tail -n 20 "$dir/log/slurmctld.log" >&2
        exit 1
    fi
    log "up: $(sinfo -h -o '%P %D node(s) %c CPUs %t')"
    echo "export SLURM_CONF=$dir/slurm.conf"
}

# stop PIDFILE NAME: TERM, then wait for the process to end (KILL after 30 s)
stop() {
    local pid i
    pid=$(pid_of "$1") || return 0
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null
    for i in $(seq 300); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    log "$2 ($pid) did not stop on TERM: KILL"
    kill -KILL "$pid" 2>/dev/null
}

down() {
    [ -d "$dir" ] || return 0
    export SLURM_CONF=$dir/slurm.conf
    if [ -f "$SLURM_CONF" ] && [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        # jobs first: with proctrack/linuxproc, stopping slurmd would leave the job's processes running
        local i
        scancel --full --quiet --user=root 2>/dev/null
        for i in $(seq 600); do
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
    stop "$dir/slurmd.pid" slurmd
    stop "$dir/slurmctld.pid" slurmctld
    stop "$dir/munge/munged.pid" munged
    rm -rf "$dir"
}

case "$action" in
    up) up ;;
    down) down ;;
    status) SLURM_CONF=$dir/slurm.conf sinfo ;;
    *) usage ;;
esac
