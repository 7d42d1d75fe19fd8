#!/usr/bin/env bash
# netns-cluster.sh: emulate an N-host cluster on one Linux machine with network namespaces.
#
# Needs: root; apt packages iproute2 (ip, tc); kernel support for netns, veth, bridge and the
# tbf qdisc (sch_netem is optional, used only for added delay).
#   apt-get update && apt-get install -y iproute2
#
# Usage:
#   netns-cluster.sh up N            create hosts h0..h(N-1)
#   netns-cluster.sh down [N]        remove them (N defaults to every host this script created)
#   netns-cluster.sh run N -- ARGS   up N, run `mpiexec ... -n N ARGS` with one rank per host,
#                                    then down N, always (also when the run fails or is
#                                    interrupted); exits with mpiexec's status
#
# Layout: bridge brpi (10.77.0.254/24) in the root namespace; namespace hI has eth0 with
# 10.77.0.(I+1)/24 (a veth pair, the root-side end pi-hI on the bridge) and loopback up.
# /etc/hosts gets "10.77.0.(I+1) hI # pipeinfer-netns" lines, removed by `down`.
# Each link end is shaped with `tbf rate $NETNS_RATE burst 32kbit latency 400ms`
# (default 1gbit). If NETNS_DELAY is set (e.g. 50us), a netem delay is tried first, with
# the tbf as its child; kernels without sch_netem get a note and only the tbf.
#
# `run` uses MPICH's Hydra (MPIEXEC, default: $VIRTUAL_ENV/bin/mpiexec, else mpiexec on PATH):
#   mpiexec -iface brpi -f HOSTFILE -launcher ssh -launcher-exec launch/netns-exec -n N ARGS
# where HOSTFILE lists h0:1 ... h(N-1):1. `-iface brpi` makes the proxies call back to
# 10.77.0.254; without it they resolve the launcher's hostname to loopback and fail.
set -uo pipefail

BR=brpi
BR_ADDR=10.77.0.254/24
NET=10.77.0
MARK="# pipeinfer-netns"
RATE=${NETNS_RATE:-1gbit}
DELAY=${NETNS_DELAY:-}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

die() { echo "netns-cluster: $*" >&2; exit 1; }

check_env() {
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    command -v ip >/dev/null && command -v tc >/dev/null ||
        die "ip/tc missing: apt-get update && apt-get install -y iproute2"
}

check_free() {
    ! ip link show "$BR" >/dev/null 2>&1 || die "$BR already exists; run '$0 down' first"
}

check_n() {
    [[ ${1:-} =~ ^[0-9]+$ && $1 -ge 1 && $1 -le 253 ]] || die "N must be 1..253, got '${1:-}'"
}

shape() {  # shape NETNS-OR-EMPTY DEV
    local ns=$1 dev=$2 pre=()
    [[ -n $ns ]] && pre=(ip netns exec "$ns")
    if [[ -n $DELAY ]]; then
        if "${pre[@]}" tc qdisc add dev "$dev" root handle 1: netem delay "$DELAY" 2>/dev/null; then
            "${pre[@]}" tc qdisc add dev "$dev" parent 1:1 handle 10: \
                tbf rate "$RATE" burst 32kbit latency 400ms ||
                echo "netns-cluster: note: tbf under netem failed on $dev" >&2
            return 0
        fi
        [[ -n ${NETEM_NOTED:-} ]] ||
            echo "netns-cluster: note: netem not available in this kernel; no delay emulated" >&2
        NETEM_NOTED=1
    fi
    "${pre[@]}" tc qdisc add dev "$dev" root tbf rate "$RATE" burst 32kbit latency 400ms ||
        echo "netns-cluster: note: tbf shaping failed on $dev, link left unshaped" >&2
}

remove_hosts_lines() {
    # rewrite in place (not sed -i): /etc/hosts may be a bind mount that cannot be replaced
    if grep -qF -- "$MARK" /etc/hosts 2>/dev/null; then
        local tmp; tmp=$(mktemp)
        grep -vF -- "$MARK" /etc/hosts >"$tmp"
        cat "$tmp" >/etc/hosts
        rm -f "$tmp"
    fi
}

up() {
    local n=$1 i
    check_n "$n"
    # make sure our lines start on a line of their own
    [[ -s /etc/hosts && -n $(tail -c1 /etc/hosts) ]] && echo >>/etc/hosts
    ip link add "$BR" type bridge || die "cannot create bridge $BR"
    ip addr add "$BR_ADDR" dev "$BR"
    ip link set "$BR" up
    for ((i = 0; i < n; i++)); do
        local h=h$i addr=$NET.$((i + 1))
        ip netns add "$h" || die "cannot create namespace $h"
        ip link add "pi-$h" type veth peer name "pi-$h-in" || die "cannot create veth for $h"
        ip link set "pi-$h-in" netns "$h"
        ip link set "pi-$h" master "$BR"
        ip link set "pi-$h" up
        ip netns exec "$h" ip link set "pi-$h-in" name eth0
        ip netns exec "$h" ip addr add "$addr/24" dev eth0
        ip netns exec "$h" ip link set eth0 up
        ip netns exec "$h" ip link set lo up
        shape "" "pi-$h"
        shape "$h" eth0
        echo "$addr $h $MARK" >>/etc/hosts
    done
    echo "netns-cluster: up: $n hosts h0..h$((n - 1)) on $BR ($BR_ADDR)" >&2
}

down() {
    local n=${1:-} i hosts=()
    if [[ -n $n ]]; then
        check_n "$n"
        for ((i = 0; i < n; i++)); do hosts+=("h$i"); done
    else  # everything this script created: marked /etc/hosts lines and pi-h* links
        mapfile -t hosts < <( { grep -F -- "$MARK" /etc/hosts 2>/dev/null | awk '{print $2}'
                                ip -o link show 2>/dev/null |
                                    sed -n 's/^[0-9]*: pi-\(h[0-9]*\)[@:].*/\1/p'; } | sort -u)
    fi
    for h in "${hosts[@]}"; do
        ip netns del "$h" 2>/dev/null
        ip link del "pi-$h" 2>/dev/null  # normally gone with the namespace
    done
    ip link del "$BR" 2>/dev/null
    remove_hosts_lines
    echo "netns-cluster: down: removed ${#hosts[@]} hosts and $BR" >&2
}

stop_run() {  # signal handler for run: stop mpiexec (Hydra kills its ranks), then exit
    if [[ -n ${MPIPID:-} ]]; then
        kill -TERM "$MPIPID" 2>/dev/null
        wait "$MPIPID" 2>/dev/null
    fi
    echo "netns-cluster: interrupted" >&2
    exit "$1"
}

run() {
    local n=$1; shift
    check_n "$n"
    [[ ${1:-} == "--" ]] && shift
    [[ $# -ge 1 ]] || die "run: nothing to run"
    local mpiexec=${MPIEXEC:-}
    if [[ -z $mpiexec ]]; then
        if [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/mpiexec ]]; then
            mpiexec=$VIRTUAL_ENV/bin/mpiexec
        else
            mpiexec=$(command -v mpiexec) || die "no mpiexec (set MPIEXEC)"
        fi
    fi
    check_free
    HOSTFILE=$(mktemp /tmp/pipeinfer-netns-hosts.XXXXXX)
    trap 'down "$n"; rm -f "$HOSTFILE"' EXIT
    MPIPID=
    trap 'stop_run 130' INT
    trap 'stop_run 143' TERM
    up "$n" || exit 1
    for ((i = 0; i < n; i++)); do echo "h$i:1"; done >"$HOSTFILE"
    local cmd=("$mpiexec" -iface "$BR" -f "$HOSTFILE" -launcher ssh
               -launcher-exec "$HERE/netns-exec" -n "$n" "$@")
    echo "netns-cluster: ${cmd[*]}" >&2
    # in the background so that a signal interrupts `wait` at once and the trap can stop mpiexec
    "${cmd[@]}" &
    MPIPID=$!
    wait "$MPIPID"
    local rc=$?
    MPIPID=
    echo "netns-cluster: mpiexec exited with $rc" >&2
    exit "$rc"
}

check_env
case ${1:-} in
    up)
        shift; [[ $# -eq 1 ]] || die "usage: $0 up N"
        N=$1; check_n "$N"; check_free
        trap '[[ ${UP_OK:-} == 1 ]] || down "$N"' EXIT  # a failed `up` leaves nothing behind
        up "$N"; UP_OK=1 ;;
    down) shift; down "${1:-}" ;;
    run) shift; [[ $# -ge 1 ]] || die "usage: $0 run N -- ARGS..."; run "$@" ;;
    *) echo "usage: $0 up N | down [N] | run N -- ARGS..." >&2; exit 2 ;;
esac
