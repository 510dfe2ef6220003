#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, to try examples/slurm/pretrain_gpt_slurm.sh
# without a cluster (and the one tests/functional/test_slurm_preemption.py runs):
#
#     apt-get install slurm-wlm munge                       # Debian/Ubuntu, as root
#     bash examples/slurm/local_cluster.sh start /tmp/slurm # prints: export SLURM_CONF=...
#     export SLURM_CONF=/tmp/slurm/slurm.conf
#     sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 \
#         examples/slurm/pretrain_gpt_slurm.sh CKPT VOCAB MERGES DATA_PREFIX --use-cpu ...
#     squeue; scontrol show job JOBID
#     bash examples/slurm/local_cluster.sh stop /tmp/slurm
#
# `start DIR` writes DIR/slurm.conf (cluster megatron-local, one node named after this host
# with CPUS cpus, default all of them; private ports; state, spool and logs in DIR) and a munge
# key, starts munged, slurmctld and slurmd as root (slurmd must be root to start jobs), and
# returns once the node is idle. `stop DIR` cancels every job and ends the daemons. On failure
# it prints the reason and the daemons' last log lines, and exits 1 (2 when a command is
# missing or this is not root).
set -euo pipefail

usage() {
    echo "usage: $0 start|stop DIR [CPUS]" >&2
    exit 2
}
[ $# -ge 2 ] || usage
action=$1
dir=$(mkdir -p "$2" && cd "$2" && pwd)
cpus=${3:-$(nproc)}
node=$(hostname -s)
export SLURM_CONF="$dir/slurm.conf"

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

logs() {
    for name in slurmctld.log slurmd.log munged.log; do
        [ -f "$dir/$name" ] && { echo "--- $name"; tail -n 15 "$dir/$name"; }
    done
    return 0
}

write_conf() {
    cat > "$SLURM_CONF" <<EOF
ClusterName=megatron-local
SlurmctldHost=$node
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge.socket
CredType=cred/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
KillWait=30
JobRequeue=1
NodeName=$node CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
}

start() {
    local missing=()
    for cmd in munged mungekey slurmctld slurmd sbatch scontrol scancel sinfo squeue; do
        command -v "$cmd" >/dev/null || missing+=("$cmd")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        echo "slurm-wlm and munge are not installed (${missing[*]} missing): apt-get install" \
             "slurm-wlm munge" >&2
        exit 2
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "slurmd must run as root to start jobs, and this is not root" >&2
        exit 2
    fi
    mkdir -p "$dir/state" "$dir/spool"
    chmod 755 "$dir"  # munged's socket must be reachable by every user
    write_conf
    rm -f "$dir/munge.key"
    mungekey --create --keyfile "$dir/munge.key"
    munged --force --socket="$dir/munge.socket" --key-file="$dir/munge.key" \
        --pid-file="$dir/munged.pid" --log-file="$dir/munged.log" --seed-file="$dir/munged.seed"
    slurmctld -i -f "$SLURM_CONF"
    slurmd -f "$SLURM_CONF" -N "$node"
    local state="" deadline=$((SECONDS + ${SLURM_START_TIMEOUT:-60}))
    while [ $SECONDS -lt $deadline ]; do
        state=$(sinfo --noheader --format=%t --nodes "$node" 2>/dev/null || true)
        if [ "$state" = idle ]; then
            echo "export SLURM_CONF=$SLURM_CONF"
            return 0
        fi
        sleep 0.5
    done
    echo "node $node not idle after ${SLURM_START_TIMEOUT:-60} s (state '$state')" >&2
    logs >&2
    stop_daemons
    exit 1
}

stop_daemons() {
    for name in slurmd slurmctld munged; do
        local pidfile="$dir/$name.pid"
        [ -f "$pidfile" ] || continue
        local pid
        pid=$(cat "$pidfile")
        if kill "$pid" 2>/dev/null; then
            for _ in $(seq 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
            kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$pidfile"
    done
}

stop() {
    if [ -f "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
        scancel --user=root --full 2>/dev/null || true
        for _ in $(seq 80); do
            [ -z "$(squeue --noheader 2>/dev/null)" ] && break
            sleep 0.5
        done
    fi
    stop_daemons
}

case $action in
    start) start ;;
    stop) stop ;;
    *) usage ;;
esac
