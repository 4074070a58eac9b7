#!/usr/bin/env bash
# A real single-node SLURM cluster on this Debian machine (for the `slurm` tests and trying sweeps locally).
#
#   scripts/slurm_local.sh start    install slurm + munge if missing (apt, as root), write /etc/slurm/slurm.conf
#                                   for this host, start munged, slurmctld and slurmd, wait until the node is idle
#   scripts/slurm_local.sh stop     stop the daemons this script started (by their pid files)
#   scripts/slurm_local.sh status   daemons and `sinfo`; exit 0 when the node is up
#
# SLURM_LOCAL_NO_INSTALL=1: fail instead of installing. Idempotent: `start` on a running cluster only checks it,
# `stop` on a stopped one does nothing. No accounting
# database (so no `sacct`), no cgroups (proctrack/linuxproc, task/none: works in a container). Partition
# `debug` (SLURM_LOCAL_PARTITION to change). Logs: /var/log/slurm/. A slurm.conf not written by this script
# (a real cluster's) is never touched: `start` refuses.
set -euo pipefail

PARTITION=${SLURM_LOCAL_PARTITION:-debug}
CONF=/etc/slurm/slurm.conf
MARK="# written by moe-lab scripts/slurm_local.sh"
LOGS=/var/log/slurm
STATE=/var/spool/slurmctld
SPOOL=/var/spool/slurmd
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_PID=/run/munge/munged.pid
WAIT_S=${SLURM_LOCAL_WAIT_S:-60}

say() { echo "slurm_local: $*" >&2; }
die() { say "$*"; exit 1; }
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sinfo >/dev/null \
        && command -v munged >/dev/null && return 0
    [[ ${SLURM_LOCAL_NO_INSTALL:-0} == 0 ]] || die "slurm is not installed (apt-get install slurmctld slurmd slurm-client munge)"
    [[ $(id -u) == 0 ]] || die "slurm is not installed and installing it needs root (apt-get)"
    command -v apt-get >/dev/null || die "slurm is not installed and this is not a Debian machine (no apt-get)"
    say "installing slurmctld slurmd slurm-client munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null \
        || die "apt-get install slurmctld slurmd slurm-client munge failed"
}

write_conf() {
    if [[ -f $CONF ]] && ! grep -qF "$MARK" "$CONF"; then
        die "$CONF exists and was not written by this script (a real cluster?): not touching it"
    fi
    # this machine's CPUs and memory as slurmd itself detects them (a larger RealMemory would drain the node)
    local hw cpus mem
    hw=$(slurmd -C | head -1)
    cpus=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$hw")
    mem=$(sed -n 's/.* RealMemory=\([0-9]*\).*/\1/p' <<<"$hw")
    [[ -n $cpus && -n $mem ]] || die "cannot read CPUs/RealMemory from 'slurmd -C': $hw"
    mkdir -p "$(dirname "$CONF")"
    local new
    new=$(cat <<EOF
$MARK
ClusterName=moelab
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$STATE
SlurmdSpoolDir=$SPOOL
SlurmctldPidFile=$CTLD_PID
SlurmdPidFile=$SLURMD_PID
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
SlurmdTimeout=60
NodeName=localhost CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)
    if [[ ! -f $CONF ]] || [[ $(cat "$CONF") != "$new" ]]; then
        echo "$new" >"$CONF"
        say "wrote $CONF (localhost: $cpus CPUs, ${mem} MB, partition $PARTITION)"
    fi
}

start_munge() {
    alive "$MUNGE_PID" && return 0
    [[ -f /etc/munge/munge.key ]] || { mungekey --create 2>/dev/null || /usr/sbin/create-munge-key -f; }
    chown munge:munge /etc/munge/munge.key 2>/dev/null || true
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    chown munge:munge /run/munge /var/log/munge /var/lib/munge 2>/dev/null || true
    if id munge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged || die "munged did not start (see /var/log/munge/munged.log)"
    else
        /usr/sbin/munged --force || die "munged did not start (see /var/log/munge/munged.log)"
    fi
}

node_state() { sinfo -h -n localhost -o %t 2>/dev/null | head -1; }

start() {
    [[ $(id -u) == 0 ]] || die "start needs root (the daemons run as root)"
    install_packages
    write_conf
    mkdir -p "$LOGS" "$STATE" "$SPOOL"
    start_munge
    if ! alive "$CTLD_PID"; then
        slurmctld || die "slurmctld did not start: $(tail -5 $LOGS/slurmctld.log 2>/dev/null)"
    fi
    if ! alive "$SLURMD_PID"; then
        slurmd -N localhost || die "slurmd did not start: $(tail -5 $LOGS/slurmd.log 2>/dev/null)"
    fi
    local state="" i
    for ((i = 0; i < WAIT_S * 2; i++)); do
        state=$(node_state)
        case $state in
            idle|mix|alloc) say "node localhost is $state (partition $PARTITION)"; return 0 ;;
            drain*|drng|down*|fail*)
                scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true ;;
        esac
        sleep 0.5
    done
    say "node not idle after ${WAIT_S}s (state '${state}'); logs:"
    tail -5 "$LOGS/slurmctld.log" "$LOGS/slurmd.log" >&2 2>/dev/null || true
    exit 1
}

stop_one() {  # pidfile name
    if alive "$1"; then
        local pid
        pid=$(cat "$1")
        kill "$pid"
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
        say "stopped $2 (pid $pid)"
    fi
    rm -f "$1"
}

stop() {
    stop_one "$SLURMD_PID" slurmd
    stop_one "$CTLD_PID" slurmctld
    stop_one "$MUNGE_PID" munged
}

status() {
    local ok=0
    for d in "munged:$MUNGE_PID" "slurmctld:$CTLD_PID" "slurmd:$SLURMD_PID"; do
        if alive "${d#*:}"; then echo "${d%%:*}: running (pid $(cat "${d#*:}"))"; else echo "${d%%:*}: stopped"; ok=1; fi
    done
    [[ $ok == 0 ]] && sinfo 2>/dev/null || true
    [[ $ok == 0 && -n $(node_state) ]]
}

case ${1:-} in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
