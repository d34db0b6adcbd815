#!/usr/bin/env bash
# A multi-node Slurm cluster on this one machine: N "nodes" (2-3), each a network namespace of its own
# (rfnode1..N, 10.77.0.1..N on a private bridge rfbr0) with its own UTS hostname (rfnodeK: what the
# processes of a job there see as their host) and its own slurmd; one slurmctld in the root namespace
# listening on the bridge (10.77.0.254). Its own cluster (ClusterName=rollflow-netns, ports 6917/6918,
# state under $ROLLFLOW_NETNS_DIR, SLURM_CONF=$ROLLFLOW_NETNS_DIR/slurm.conf) beside infra/slurm/up.sh's
# one-node cluster, whose daemons it never touches (it finds its own by pid file only). munge is shared.
#
# Hostnames: each namespace gets /etc/netns/rfnodeK/hosts (this machine's /etc/hosts plus the nodes'
# lines), bind-mounted over /etc/hosts in the node's own mount namespace (iproute2's `ip netns exec`
# convention): the nodes resolve each other, the machine's global /etc/hosts is never edited.
#
#   infra/slurm/netns.sh up N      bring it up, wait until the N nodes are idle (bounded), print them
#   infra/slurm/netns.sh down      stop its daemons, remove namespaces, links, hosts files and state
#   infra/slurm/netns.sh kill K    node loss: SIGKILL every process of namespace rfnodeK (its slurmd too)
#   infra/slurm/netns.sh start K   bring node K back (its slurmd), wait until Slurm counts it up
#   eval "$(infra/slurm/netns.sh env)"   SLURM_CONF for the sbatch/squeue/srun of this cluster
set -euo pipefail

STATE=${ROLLFLOW_NETNS_DIR:-/var/lib/rollflow-netns}
CONF=$STATE/slurm.conf
BRIDGE=rfbr0
NET=10.77.0
CTL_ADDR=$NET.254
HOST=$(hostname -s)
MAX_NODES=3
# The daemons run under names of their own (symlinks to Slurm's binaries: the kernel names a process after
# the path it was exec'd by), so that `ps -C slurmd`, `pkill slurmd` or an older up.sh --down that stops
# "the" slurmd by name never reach this cluster's daemons.
CTLD=rfnet-slurmctld
SLURMD=rfnet-slurmd

log() { echo "slurm-netns: $*" >&2; }
# The pid in a pid file, if that process is alive and is the named daemon (not a recycled pid).
pid_of() {
    local pid
    pid=$(cat "$1" 2>/dev/null || true)
    [[ -n "$pid" && "$(cat "/proc/$pid/comm" 2>/dev/null || true)" == "$2" ]] && echo "$pid" || true
}
node_count() { cat "$STATE/nodes" 2>/dev/null || echo 0; }
node_pids() { ip netns pids "rfnode$1" 2>/dev/null || true; }

write_config() {
    local n=$1 i nodes=""
    mkdir -p "$STATE/ctld" "$STATE/log" "$STATE/run"
    for i in $(seq 1 "$n"); do mkdir -p "$STATE/spool/rfnode$i"; nodes+="rfnode$i,"; done
    cat >"$CONF.tmp" <<EOF
# Written by rollflow infra/slurm/netns.sh: $n nodes in network namespaces on bridge $BRIDGE.
ClusterName=rollflow-netns
SlurmctldHost=${HOST}(${CTL_ADDR})
SlurmctldPort=6917
SlurmdPort=6918
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/run/slurmctld.pid
SlurmdPidFile=$STATE/run/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
DefMemPerCPU=1024
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
EnforcePartLimits=ALL
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SlurmctldTimeout=30
# A lost node is declared down after this long without an answer (node loss, tests/soak/multinode.py).
SlurmdTimeout=10
InactiveLimit=0
MinJobAge=300
KillWait=5
OverTimeLimit=0
NodeName=DEFAULT CPUs=2 RealMemory=4096 State=UNKNOWN
EOF
    for i in $(seq 1 "$n"); do
        echo "NodeName=rfnode$i NodeAddr=$NET.$i NodeHostname=rfnode$i" >>"$CONF.tmp"
    done
    echo "PartitionName=debug Nodes=${nodes%,} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO" >>"$CONF.tmp"
    mv "$CONF.tmp" "$CONF"
    echo "$n" >"$STATE/nodes"
}

make_network() {
    local n=$1 i
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$CTL_ADDR/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    for i in $(seq 1 "$n"); do
        ip netns list | grep -qw "rfnode$i" || ip netns add "rfnode$i"
        if ! ip link show "rfv$i" >/dev/null 2>&1; then
            ip link add "rfv$i" type veth peer name eth0 netns "rfnode$i"
        fi
        ip link set "rfv$i" master "$BRIDGE" up
        ip -n "rfnode$i" addr replace "$NET.$i/24" dev eth0
        ip -n "rfnode$i" link set eth0 up
        ip -n "rfnode$i" link set lo up
    done
}

write_hosts() {
    local n=$1 i j
    for i in $(seq 1 "$n"); do
        mkdir -p "/etc/netns/rfnode$i"
        {
            echo "127.0.0.1 localhost"
            grep -v -e '^127\.' -e '^::1' /etc/hosts || true
            echo "$CTL_ADDR $HOST-rfctl"
            for j in $(seq 1 "$n"); do echo "$NET.$j rfnode$j"; done
        } >"/etc/netns/rfnode$i/hosts"
    done
}

start_munge() {
    if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
        [[ -s /etc/munge/munge.key ]] || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
        chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
        mkdir -p /run/munge /var/lib/munge /var/log/munge
        chown munge:munge /run/munge /var/lib/munge /var/log/munge
        runuser -u munge -- /usr/sbin/munged --force
    fi
}

start_node() {
    local i=$1
    [[ -n "$(pid_of "$STATE/run/slurmd.rfnode$i.pid" "$SLURMD")" ]] && return 0
    rm -f "$STATE/run/slurmd.rfnode$i.pid"
    # The node's network namespace; a UTS namespace of its own (gethostname() is rfnodeK for slurmd and every
    # job process on the node); a mount namespace (slave: the filesystem stays shared) with the node's hosts
    # file over /etc/hosts. Not `ip netns exec`: it remounts /sys without the cgroup fs slurmd needs.
    nsenter --net="/run/netns/rfnode$i" unshare --uts --mount --propagation slave sh -c \
        'mount --bind "/etc/netns/$1/hosts" /etc/hosts && hostname "$1" && exec "$3" -f "$2" -N "$1"' \
        _ "rfnode$i" "$CONF" "$STATE/bin/$SLURMD"
}

wait_up() {  # $1: node list; bounded: 60 s
    local state
    for _ in $(seq 1 120); do
        state=$(SLURM_CONF=$CONF sinfo -h -N -n "$1" -o %t 2>/dev/null | sort -u | tr '\n' ' ' || true)
        case "$state" in
            "idle "|"mix "|"alloc "|"idle mix "|"alloc idle "|"alloc mix "|"alloc idle mix ")
                SLURM_CONF=$CONF sinfo -N -h -n "$1" -o "%N %t %c %m"; return 0 ;;
            *down*|*drain*) SLURM_CONF=$CONF scontrol update NodeName="$1" State=RESUME 2>/dev/null || true ;;
        esac
        sleep 0.5
    done
    log "nodes $1 not up (states: ${state:-none}); see $STATE/log/"
    return 1
}

up() {
    local n=${1:-3} i
    [[ $(id -u) -eq 0 ]] || { log "must run as root"; exit 1; }
    [[ "$n" =~ ^[2-3]$ ]] || { log "N must be 2 or $MAX_NODES"; exit 1; }
    if [[ "$(node_count)" != 0 && "$(node_count)" != "$n" ]]; then down; fi
    write_config "$n"
    make_network "$n"
    write_hosts "$n"
    start_munge
    mkdir -p "$STATE/bin"
    ln -sf "$(command -v slurmctld)" "$STATE/bin/$CTLD"
    ln -sf "$(command -v slurmd)" "$STATE/bin/$SLURMD"
    [[ -n "$(pid_of "$STATE/run/slurmctld.pid" "$CTLD")" ]] || "$STATE/bin/$CTLD" -f "$CONF"
    for i in $(seq 1 "$n"); do start_node "$i"; done
    wait_up "rfnode[1-$n]"
}

stop_pid() {  # SIGTERM, then SIGKILL after 10 s
    local pid=$1
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
    kill -9 "$pid" 2>/dev/null || true
}

kill_node() {  # every process of the namespace, its slurmd included; repeated: a dying job may fork
    local i=$1 pids
    for _ in $(seq 1 20); do
        pids=$(node_pids "$i")
        [[ -z "$pids" ]] && return 0
        # shellcheck disable=SC2086 # one pid per word
        kill -9 $pids 2>/dev/null || true
        sleep 0.1
    done
    log "rfnode$i still has processes: $(node_pids "$i" | tr '\n' ' ')"
    return 1
}

down() {
    local n i
    n=$(node_count)
    for i in $(seq 1 "$MAX_NODES"); do kill_node "$i" || true; done
    pid=$(pid_of "$STATE/run/slurmctld.pid" "$CTLD")
    [[ -n "$pid" ]] && stop_pid "$pid"
    for i in $(seq 1 "$MAX_NODES"); do
        ip link del "rfv$i" 2>/dev/null || true
        ip netns del "rfnode$i" 2>/dev/null || true
        rm -rf "/etc/netns/rfnode$i"
    done
    rmdir /etc/netns 2>/dev/null || true  # only when empty: other namespaces' files stay
    ip link del "$BRIDGE" 2>/dev/null || true
    rm -rf "$STATE"
    log "down ($n nodes removed)"
}

case "${1:-}" in
    up) up "${2:-3}" ;;
    down) down ;;
    kill) kill_node "${2:?node number}" ;;
    start) start_node "${2:?node number}" && wait_up "rfnode$2" ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) echo "usage: $0 up N | down | kill K | start K | env" >&2; exit 2 ;;
esac
