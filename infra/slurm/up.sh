#!/usr/bin/env bash
# Bring up a single-node Slurm cluster on loopback (munge + slurmctld + slurmd, as root, no systemd) and
# wait until its node is idle. Idempotent: installs Debian's packages if missing, writes the config only
# when it changed, starts only the daemons that are not running. Used by the test suite (session fixture)
# and by a developer who wants a cluster on this machine: `sudo infra/slurm/up.sh`.
#
#   infra/slurm/up.sh          bring it up (prints the node line when ready)
#   infra/slurm/up.sh --down   stop the daemons this script starts
set -euo pipefail

CONF_DIR=/etc/slurm
HOST=$(hostname -s)
CPUS=$(nproc)
MEM_MB=$(awk '/MemTotal/ {printf "%d", $2 / 1024 * 0.85}' /proc/meminfo)

log() { echo "slurm-up: $*" >&2; }
# This cluster's live daemon $1, by its pid file: not by name, since infra/slurm/netns.sh runs daemons of
# the same names beside it (never ours to stop). Not a zombie (a daemon stopped here can linger as one under
# PID 1), and still that daemon (a pid file can outlive its process, and the pid be reused).
alive() {
    local pid
    pid=$(cat "/run/slurm/$1.pid" 2>/dev/null || true)
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == "$1" ]] || return 0
    awk '$3 != "Z" {print $1}' "/proc/$pid/stat" 2>/dev/null || true
}

if [[ "${1:-}" == "--down" ]]; then
    for d in slurmd slurmctld; do
        pid=$(alive "$d"); [[ -n "$pid" ]] && kill $pid
    done
    exit 0
fi

[[ $(id -u) -eq 0 ]] || { log "must run as root (it installs packages and starts daemons)"; exit 1; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return
    fi
    log "installing slurmctld slurmd slurm-client munge"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client munge >/dev/null
}

write_config() {
    mkdir -p "$CONF_DIR" /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/slurm
    local tmp
    tmp=$(mktemp)
    cat >"$tmp" <<EOF
# Written by rollflow infra/slurm/up.sh: a single-node cluster on loopback.
ClusterName=rollflow
SlurmctldHost=${HOST}(127.0.0.1)
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurm/slurmctld.pid
SlurmdPidFile=/run/slurm/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
# Reject at submission what the partition can never run (too many nodes, ...), as most clusters do.
EnforcePartLimits=ALL
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=300
KillWait=10
OverTimeLimit=0
NodeName=${HOST} NodeAddr=127.0.0.1 CPUs=${CPUS} RealMemory=${MEM_MB} State=UNKNOWN
PartitionName=debug Nodes=${HOST} Default=YES MaxTime=INFINITE MaxNodes=1 State=UP OverSubscribe=NO
EOF
    if ! cmp -s "$tmp" "$CONF_DIR/slurm.conf"; then
        mv "$tmp" "$CONF_DIR/slurm.conf"
        chmod 644 "$CONF_DIR/slurm.conf"
        CONFIG_CHANGED=1
    else
        rm -f "$tmp"
    fi
}

start_munge() {
    if [[ ! -s /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    # A credential round trip, not pgrep: a defunct munged would still match the name.
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        runuser -u munge -- /usr/sbin/munged --force
    fi
}

start_slurm() {
    if [[ "${CONFIG_CHANGED:-0}" == 1 ]]; then
        for d in slurmd slurmctld; do
            pid=$(alive "$d")
            if [[ -n "$pid" ]]; then kill $pid; while [[ -n "$(alive "$d")" ]]; do sleep 0.2; done; fi
        done
    fi
    [[ -n "$(alive slurmctld)" ]] || slurmctld
    [[ -n "$(alive slurmd)" ]] || slurmd
}

wait_idle() {
    local state
    for _ in $(seq 1 120); do
        state=$(sinfo -h -n "$HOST" -o %t 2>/dev/null || true)
        case "$state" in
            idle|mix|alloc) sinfo -N -h -n "$HOST" -o "%N %t %c %m"; return 0 ;;
            down*|drain*) scontrol update NodeName="$HOST" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    log "node $HOST did not become idle (state: ${state:-none}); see /var/log/slurm/"
    return 1
}

install_packages
write_config
start_munge
start_slurm
wait_idle
