#!/usr/bin/env bash
# A real two-node SLURM cluster on this machine, for trying and testing the SLURM path.
#
#   slurm/testcluster.sh up                 # as root: install slurm-wlm + munge if missing, start daemons
#   slurm/testcluster.sh status             # sinfo
#   slurm/testcluster.sh exec sbatch ...    # any SLURM client command, from this directory, with this environment
#   slurm/testcluster.sh node n2 CMD...     # a command on compute node n2 (its network namespace and hosts file)
#   slurm/testcluster.sh down               # stop the daemons it started (by pid), delete namespaces and links
#
# Layout: a bridge in namespace ${PREFIX}br joins, by veth pairs, the controller's namespace
# ${PREFIX}ctl (slurmctld, and every client command run by `exec`) and one namespace per compute
# node, ${PREFIX}n1 and ${PREFIX}n2, each running its own slurmd. Addresses ($NET.1 controller,
# $NET.11/.12 nodes) exist only inside those namespaces. Each daemon runs in a private mount
# namespace (a UTS namespace too on a node, named after it) where a hosts file of the cluster is bind-mounted over /etc/hosts, so every node
# resolves every name and no file of this machine is changed. `ip netns exec` is not used: it
# remounts /sys, which hides /sys/fs/cgroup, and slurmd then refuses to start.
# munged runs with its own key and socket, and slurm.conf is written to $STATE (SLURM_CONF).
#
# Variables: MF_SLURM_PREFIX (namespace names, default mfsl; at most 8 characters), MF_SLURM_STATE
# (default /tmp/megaformer-testcluster, with the prefix appended when it is not the default),
# MF_SLURM_NET (default 10.77.0). Clusters with different prefixes run side by side: every
# address lives inside that cluster's own namespaces.

set -euo pipefail

PREFIX=${MF_SLURM_PREFIX:-mfsl}
[ ${#PREFIX} -le 8 ] || { echo "testcluster: MF_SLURM_PREFIX=$PREFIX: at most 8 characters" >&2; exit 1; }
DEFAULT_STATE=/tmp/megaformer-testcluster
[ "$PREFIX" = mfsl ] || DEFAULT_STATE=$DEFAULT_STATE-$PREFIX
STATE=${MF_SLURM_STATE:-$DEFAULT_STATE}
NET=${MF_SLURM_NET:-10.77.0}
NODES=(n1 n2)
CTL_ADDR=$NET.1
CTL_HOST=$(hostname)

die() {
    echo "testcluster: $*" >&2
    exit 1
}

node_addr() { echo "$NET.$((10 + ${1#n}))"; }

# Run "$@" in namespace $1's network and a private mount namespace with the cluster's hosts file;
# on a compute node also in its own UTS namespace whose host name is the node's name (as on a real
# cluster: gloo and the TP-group check find a rank's address and node from its host name).
in_ns() {
    local ns=$1 uts=()
    shift
    [ "$ns" = ctl ] || uts=(-u)
    # shellcheck disable=SC2016  # expanded by the inner bash
    nsenter --net="/var/run/netns/$PREFIX$ns" unshare -m "${uts[@]}" --propagation private \
        bash -c 'mount --bind "$0" /etc/hosts && { [ "$1" = ctl ] || hostname "$1"; } && shift && exec "$@"' \
        "$STATE/hosts" "$ns" "$@"
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
    [ "$(id -u)" = 0 ] || die "slurm-wlm and munge are not installed, and installing them needs root"
    echo "testcluster: installing slurm-wlm and munge with apt-get" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null || die "apt-get update failed (is the Debian mirror reachable?)"
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null ||
        die "apt-get install slurm-wlm munge failed"
}

write_config() {
    mkdir -p "$STATE"/{state,log,munge,spool/n1,spool/n2}
    chmod 700 "$STATE/munge"
    {
        echo "127.0.0.1 localhost"
        echo "$CTL_ADDR $CTL_HOST ctl"
        for n in "${NODES[@]}"; do echo "$(node_addr "$n") $n"; done
    } >"$STATE/hosts"
    cat >"$STATE/slurm.conf" <<EOF
ClusterName=megaformer-test
SlurmctldHost=$CTL_HOST($CTL_ADDR)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$STATE/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool/%n
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.%n.pid
SlurmctldLogFile=$STATE/log/slurmctld.log
SlurmdLogFile=$STATE/log/slurmd.%n.log
SlurmdParameters=config_overrides
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=20
MinJobAge=300
SlurmdTimeout=30
InactiveLimit=0
NodeName=n1 NodeAddr=$(node_addr n1) CPUs=4 RealMemory=4000 State=UNKNOWN
NodeName=n2 NodeAddr=$(node_addr n2) CPUs=4 RealMemory=4000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
}

make_network() {
    ip netns add "${PREFIX}br"
    ip -n "${PREFIX}br" link add br0 type bridge
    ip -n "${PREFIX}br" link set lo up
    ip -n "${PREFIX}br" link set br0 up
    local ns addr
    for ns in ctl "${NODES[@]}"; do
        ip netns add "$PREFIX$ns"
        if [ "$ns" = ctl ]; then addr=$CTL_ADDR; else addr=$(node_addr "$ns"); fi
        ip link add "${PREFIX}$ns-a" netns "$PREFIX$ns" type veth peer name "${PREFIX}$ns-b" netns "${PREFIX}br"
        ip -n "$PREFIX$ns" link set lo up
        ip -n "$PREFIX$ns" link set "${PREFIX}$ns-a" name eth0
        ip -n "$PREFIX$ns" addr add "$addr/24" dev eth0
        ip -n "$PREFIX$ns" link set eth0 up
        ip -n "${PREFIX}br" link set "${PREFIX}$ns-b" master br0
        ip -n "${PREFIX}br" link set "${PREFIX}$ns-b" up
    done
}

start_daemons() {
    [ -f "$STATE/munge/munge.key" ] || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 status=none
    chmod 600 "$STATE/munge/munge.key"
    munged --force --key-file="$STATE/munge/munge.key" --socket="$STATE/munge/munge.socket" \
        --pid-file="$STATE/munge/munged.pid" --log-file="$STATE/log/munged.log" --seed-file="$STATE/munge/seed"
    export SLURM_CONF=$STATE/slurm.conf
    in_ns ctl slurmctld -f "$SLURM_CONF"
    local n
    for n in "${NODES[@]}"; do in_ns "$n" slurmd -f "$SLURM_CONF" -N "$n"; done
    for _ in $(seq 1 60); do
        if in_ns ctl sinfo -h -o '%t %D' 2>/dev/null | grep -qx 'idle 2'; then return; fi
        sleep 0.5
    done
    in_ns ctl sinfo >&2 || true
    tail -n 20 "$STATE"/log/*.log >&2 || true
    die "the nodes did not become idle within 30 s (logs above, and in $STATE/log)"
}

up() {
    [ "$(id -u)" = 0 ] || die "needs root (network namespaces, daemons)"
    [ ! -e "/var/run/netns/${PREFIX}br" ] || die "already up (run '$0 down' first)"
    install_packages
    rm -rf "$STATE"
    write_config
    make_network
    start_daemons
    echo "testcluster: up: controller $CTL_HOST ($CTL_ADDR), nodes ${NODES[*]}; state in $STATE"
}

kill_pidfile() {
    local pid
    [ -f "$1" ] || return 0
    pid=$(cat "$1")
    kill "$pid" 2>/dev/null || return 0
    for _ in $(seq 1 50); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -9 "$pid" 2>/dev/null || true
}

down() {
    local n ns
    for n in "${NODES[@]}"; do kill_pidfile "$STATE/slurmd.$n.pid"; done
    kill_pidfile "$STATE/slurmctld.pid"
    kill_pidfile "$STATE/munge/munged.pid"
    # Job processes the slurmds left behind live in the node namespaces: stop them by pid.
    for ns in ctl "${NODES[@]}" br; do
        [ -e "/var/run/netns/$PREFIX$ns" ] || continue
        for pid in $(ip netns pids "$PREFIX$ns" 2>/dev/null); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$PREFIX$ns"
    done
    rm -rf "$STATE"
    echo "testcluster: down"
}

case "${1:-}" in
up) up ;;
down) down ;;
status) SLURM_CONF=$STATE/slurm.conf in_ns ctl sinfo ;;
exec)
    shift
    [ -f "$STATE/slurm.conf" ] || die "not up (run '$0 up')"
    SLURM_CONF=$STATE/slurm.conf in_ns ctl "$@"
    ;;
node)
    [ $# -ge 3 ] || die "usage: $0 node NODE CMD..."
    node=$2
    shift 2
    SLURM_CONF=$STATE/slurm.conf in_ns "$node" "$@"
    ;;
*) die "usage: $0 up|down|status|exec CMD...|node NODE CMD..." ;;
esac
