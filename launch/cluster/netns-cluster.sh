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
# Each link end is shaped with `tbf rate $NETNS_RATE burst $NETNS_BURST latency 400ms`
# (defaults 1gbit and 512kbit: 64 KiB, one GSO packet; with a 32kbit burst tbf splits every GSO
# packet and MPI got only 345 Mbit/s through a 1gbit link, with 512kbit it measured 1023 Mbit/s,
# and 106 / 10.7 Mbit/s through 100mbit / 10mbit links). If NETNS_DELAY is set (e.g. 50us), a netem delay is tried first, with
# the tbf as its child; kernels without sch_netem get a note and only the tbf.
#
# `run` uses MPICH's Hydra (MPIEXEC, default: $VIRTUAL_ENV/bin/mpiexec, else mpiexec on PATH):
#   mpiexec -iface brpi -f HOSTFILE -launcher ssh -launcher-exec launch/cluster/netns-exec
#           -genv UCX_TLS tcp -genv FI_PROVIDER tcp -n N ARGS
# where HOSTFILE lists h0:1 ... h(N-1):1. `-iface brpi` makes the proxies call back to
# 10.77.0.254; without it they resolve the launcher's hostname to loopback and fail.
#
# MPI traffic must cross the links. Namespaces share one kernel, and MPICH's default device
# (ch4:ucx) then moves messages through shared memory whatever the hostnames (measured: 48 Gbit/s
# between two hosts shaped to 100 Mbit/s). So every mpiexec here gets the settings that force its
# transports onto TCP (mpi_tcp_args: UCX_TLS=tcp for ch4:ucx, FI_PROVIDER=tcp for ch4:ofi), and
# after `up` (N >= 2), and before `run` starts its job, an MPI ping-pong between h0 and h1
# (python -m pipeinfer.wire.netprobe) prints the bandwidth and latency MPI really gets; `run` refuses
# to go on when that is more than twice the shaped rate. NETNS_MPI_TCP=0 leaves the transports
# alone (to show the problem); PYTHON picks the interpreter for the probe (default: the one
# beside mpiexec, else python3).
#
# Disks: with NETNS_DISKS=DIR every host also gets a disk view of its own (launch/cluster/netns-exec): a mount namespace
# in which DIR/hI/stages and DIR/hI/weights are bind-mounted over the pipeinfer cache's stages/ and weights/, and,
# on every host but h0, an empty read-only tmpfs over each folder of NETNS_HIDE (default: the cache's models/), so
# that only h0 has the model (docs/cluster.md, weights travel). NETNS_HIDE= (empty) hides nothing.
# CPUs: NETNS_CPUS="h1:0 h2:1" gives those hosts only those CPUs (netns-exec: taskset), unequal hosts.
#
# Latency: netem is missing from some kernels (this project's machines among them), and without it
# tc cannot add delay; the script then says so and shapes the rate only. A real Ethernet hop adds
# 50-200 us; carry that in the digital twin (or NETNS_DELAY where netem exists).
set -uo pipefail

BR=brpi
BR_ADDR=10.77.0.254/24
NET=10.77.0
MARK="# pipeinfer-netns"
RATE=${NETNS_RATE:-1gbit}
DELAY=${NETNS_DELAY:-}
BURST=${NETNS_BURST:-512kbit}
MPI_TCP=${NETNS_MPI_TCP:-1}
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
                tbf rate "$RATE" burst "$BURST" latency 400ms ||
                echo "netns-cluster: note: tbf under netem failed on $dev" >&2
            return 0
        fi
        [[ -n ${NETEM_NOTED:-} ]] ||
            echo "netns-cluster: note: netem not available in this kernel; no delay emulated" >&2
        NETEM_NOTED=1
    fi
    "${pre[@]}" tc qdisc add dev "$dev" root tbf rate "$RATE" burst "$BURST" latency 400ms ||
        echo "netns-cluster: note: tbf shaping failed on $dev, link left unshaped" >&2
}

rate_bits() {  # rate_bits TC-RATE: bits per second (tc units: bit kbit mbit gbit tbit bps kbps mbps gbps)
    local r=${1,,} num unit mult
    [[ $r =~ ^([0-9]+)([kmgt]?)(bit|bps)$ ]] || die "cannot read the rate '$1' (use e.g. 100mbit or 1gbit)"
    num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[2]}
    case $unit in k) mult=1000 ;; m) mult=1000000 ;; g) mult=1000000000 ;; t) mult=1000000000000 ;; *) mult=1 ;; esac
    [[ ${BASH_REMATCH[3]} == bps ]] && mult=$((mult * 8))
    echo $((num * mult))
}

find_mpiexec() {
    if [[ -n ${MPIEXEC:-} ]]; then
        echo "$MPIEXEC"
    elif [[ -n ${VIRTUAL_ENV:-} && -x $VIRTUAL_ENV/bin/mpiexec ]]; then
        echo "$VIRTUAL_ENV/bin/mpiexec"
    else
        command -v mpiexec || die "no mpiexec (set MPIEXEC)"
    fi
}

mpi_tcp_args() {  # mpi_tcp_args MPIEXEC: the arguments that force every transport of this MPI onto TCP
    local mpiexec=$1 version
    [[ $MPI_TCP == 0 ]] && return 0
    version=$("$mpiexec" --version 2>&1 | head -20)
    if [[ $version == *"Open MPI"* || $version == *"OpenRTE"* ]]; then
        die "Open MPI's mpirun is not supported here (the script uses Hydra's -iface and -launcher); use the mpich wheel's mpiexec"
    fi
    # MPICH (Hydra): ch4:ucx reads UCX_TLS, ch4:ofi reads FI_PROVIDER; each ignores the other's
    echo -genv UCX_TLS tcp -genv FI_PROVIDER tcp
}

launch_args() {  # launch_args MPIEXEC HOSTFILE: mpiexec's arguments for the emulated hosts
    echo -iface "$BR" -f "$2" -launcher ssh -launcher-exec "$HERE/netns-exec" $(mpi_tcp_args "$1")
}

check_links() {  # check_links N [strict]: MPI ping-pong h0 <-> h1; strict: refuse > 2x the shaped rate
    local n=$1 strict=${2:-} mpiexec py hostfile line mbit
    [[ $n -ge 2 ]] || return 0
    mpiexec=$(find_mpiexec) || return 1
    py=${PYTHON:-$(dirname "$mpiexec")/python}
    [[ -x $py ]] || py=$(command -v python3)
    hostfile=$(mktemp /tmp/pipeinfer-netns-probe.XXXXXX)
    printf 'h0:1\nh1:1\n' >"$hostfile"
    line=$("$mpiexec" $(launch_args "$mpiexec" "$hostfile") -n 2 "$py" -m mpi4py -m pipeinfer.wire.netprobe 2>&1 |
           grep '^netprobe:' | tail -1)
    rm -f "$hostfile"
    [[ $line == *bandwidth* ]] || die "the MPI ping-pong between h0 and h1 failed: ${line:-no output} (is pipeinfer installed for $py?)"
    echo "netns-cluster: $line; links shaped to $RATE" >&2
    mbit=$(sed -n 's/.*bandwidth \([0-9.]*\) Mbit\/s.*/\1/p' <<<"$line")
    if [[ -n $strict ]] && awk -v m="$mbit" -v r="$(rate_bits "$RATE")" 'BEGIN { exit !(m * 1e6 > 2 * r) }'; then
        die "MPI traffic between h0 and h1 ran at $mbit Mbit/s, more than twice the links' $RATE: it is not crossing the emulated network (NETNS_MPI_TCP=$MPI_TCP)"
    fi
    return 0
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
    local mpiexec
    mpiexec=$(find_mpiexec) || exit 1
    rate_bits "$RATE" >/dev/null || exit 1
    mpi_tcp_args "$mpiexec" >/dev/null || exit 1
    check_free
    HOSTFILE=$(mktemp /tmp/pipeinfer-netns-hosts.XXXXXX)
    trap 'down "$n"; rm -f "$HOSTFILE"' EXIT
    MPIPID=
    trap 'stop_run 130' INT
    trap 'stop_run 143' TERM
    up "$n" || exit 1
    for ((i = 0; i < n; i++)); do echo "h$i:1"; done >"$HOSTFILE"
    check_links "$n" strict || exit 1
    local cmd=("$mpiexec" $(launch_args "$mpiexec" "$HOSTFILE") -n "$n" "$@")
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
        rate_bits "$RATE" >/dev/null || exit 1
        trap '[[ ${UP_OK:-} == 1 ]] || down "$N"' EXIT  # a failed `up` leaves nothing behind
        up "$N"; UP_OK=1
        check_links "$N" ;;
    down) shift; down "${1:-}" ;;
    run) shift; [[ $# -ge 1 ]] || die "usage: $0 run N -- ARGS..."; run "$@" ;;
    *) echo "usage: $0 up N | down [N] | run N -- ARGS..." >&2; exit 2 ;;
esac
