#!/usr/bin/env bash
# slurm-netns.sh: a real Slurm (Debian slurm-wlm 22.05 + munge) whose nodes h0..h(N-1) are the network
# namespaces of netns-cluster.sh, so that srun places each task (MPI rank) on an emulated host.
#
#   slurm-netns.sh up N     namespaces (netns-cluster.sh up N), munged, slurm.conf, slurmctld, N slurmds;
#                           waits until sinfo shows N idle nodes. Again with the same N: nothing to do.
#   slurm-netns.sh down     cancel jobs, stop every daemon this script started, remove its state dir,
#                           netns-cluster.sh down (only if this script created the namespaces)
#   slurm-netns.sh status
# Then:  . $SLURM_NETNS_DIR/env.sh   (SLURM_CONF, and the MPI settings that keep traffic on the links)
#        srun -N 3 -n 3 hostname ; srun --mpi=pmi2 ... (MPICH) ; srun --mpi=pmix ... (Open MPI)
#
# Environment: SLURM_NETNS_DIR (state, default /tmp/slurm-netns), NETNS_CLUSTER (default: netns-cluster.sh beside
# this script), SLURM_NETNS_CPUS (CPUs per node, default nproc),
# SLURM_NETNS_PORTS ("6817 6818": slurmctld and slurmd ports). NETNS_RATE etc. go to netns-cluster.sh.
# Layout: slurmctld + munged in the root namespace (slurmctld on 10.77.0.254 = bridge brpi); slurmd hI is
# started with `nsenter --net=/run/netns/hI` (not `ip netns exec`: that remounts /sys, hiding
# /sys/fs/cgroup, and slurmd 22.05 then dies "Unable to initialize cgroup plugin").
# Needs root and: apt-get install -y slurmctld slurmd slurm-client munge libpmix-dev
# (libpmix-dev only for --mpi=pmix: Slurm's plugin dlopens the unversioned libpmix.so).
set -uo pipefail

DIR=${SLURM_NETNS_DIR:-/tmp/slurm-netns}
NETNS_CLUSTER=${NETNS_CLUSTER:-$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/netns-cluster.sh}
read -r CTLD_PORT SLURMD_PORT <<<"${SLURM_NETNS_PORTS:-6817 6818}"
CONF=$DIR/slurm.conf
SOCK=$DIR/munge-run/munge.sock
export SLURM_CONF=$CONF

die() { echo "slurm-netns: $*" >&2; exit 1; }
note() { echo "slurm-netns: $*" >&2; }

# pids of our daemons: processes named $1 whose environment has our SLURM_CONF (slurmctld, slurmd, slurmstepd)
our_pids() {
    local name=$1 p
    for p in $(pgrep -x "$name" 2>/dev/null); do
        tr '\0' '\n' 2>/dev/null <"/proc/$p/environ" | grep -qxF "SLURM_CONF=$CONF" && echo "$p"
    done
}
munged_pid() {
    local p
    for p in $(pgrep -x munged 2>/dev/null); do
        tr '\0' ' ' 2>/dev/null <"/proc/$p/cmdline" | grep -qF -- "--socket=$SOCK" && echo "$p"
    done
}

stop_pids() {  # stop_pids PID...: TERM, wait up to 10 s, then KILL
    local p k alive
    [[ $# -gt 0 ]] || return 0
    kill -TERM "$@" 2>/dev/null
    for k in $(seq 50); do
        alive=0
        for p in "$@"; do kill -0 "$p" 2>/dev/null && alive=1; done
        [[ $alive == 0 ]] && return 0
        sleep 0.2
    done
    note "still running after 10 s, killing: $*"
    kill -KILL "$@" 2>/dev/null
    sleep 0.5
}

n_idle() { sinfo -h -N -t idle -o %N 2>/dev/null | sort -u | grep -c .; }

write_conf() {  # write_conf N
    local n=$1 i cpus=${SLURM_NETNS_CPUS:-$(nproc)}
    cat >"$CONF" <<EOF
# written by slurm-netns.sh: node hI = network namespace hI (10.77.0.(I+1)), slurmctld on brpi (10.77.0.254)
ClusterName=netns
SlurmctldHost=$(hostname)(10.77.0.254)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$SOCK
StateSaveLocation=$DIR/ctld
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmctldLogFile=$DIR/slurmctld.log
# one spool dir, pid file, log and TmpFS per node (%n = node name); the PMIx plugin makes its
# spmix_appdir_* under TmpFS, and a shared /tmp makes the second node fail with "File exists"
SlurmdSpoolDir=$DIR/slurmd-%n
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmdLogFile=$DIR/slurmd-%n.log
TmpFS=$DIR/tmp-%n
# no cgroups
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
# every task learns its emulated host (pipeinfer reads PIPEINFER_HOST; Slurm also sets SLURMD_NODENAME) and its
# node-local scratch (SLURM_TMPDIR)
TaskProlog=$DIR/task-prolog.sh
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
InactiveLimit=0
KillWait=5
MinJobAge=30
SlurmctldDebug=info
SlurmdDebug=info
EOF
    for ((i = 0; i < n; i++)); do
        echo "NodeName=h$i NodeAddr=10.77.0.$((i + 1)) CPUs=$cpus State=UNKNOWN"
        mkdir -p "$DIR/slurmd-h$i" "$DIR/tmp-h$i"
    done >>"$CONF"
    echo "PartitionName=emu Nodes=h[0-$((n - 1))] Default=YES MaxTime=INFINITE State=UP" >>"$CONF"
    # and its node-local scratch, as sites set SLURM_TMPDIR (a folder per node: what pipeinfer's caches use there)
    printf '#!/bin/sh\necho "export PIPEINFER_HOST=$SLURMD_NODENAME"\necho "export SLURM_TMPDIR=%s/tmp-$SLURMD_NODENAME"\n' \
        "$DIR" >"$DIR/task-prolog.sh"
    chmod 755 "$DIR/task-prolog.sh"
    # MPI over the links: UCX_TLS=tcp, FI_PROVIDER=tcp as netns-cluster.sh; under srun the mpich wheel on its OFI
    # netmod, as `pipeinfer launch` runs it (a UCX address makes PMI-1 lines the pmi2 plugin reads in pieces:
    # "mpi/pmi2: value not properly terminated in client request", and MPI_Init fails; pipeinfer/wire/slurm.py)
    printf 'export SLURM_CONF=%s UCX_TLS=tcp FI_PROVIDER=tcp MPIR_CVAR_CH4_NETMOD=ofi\n' "$CONF" >"$DIR/env.sh"
}

up() {
    local n=$1 i k t0=$SECONDS
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 253 ]] || die "N must be 1..253, got '$n'"
    [[ $(id -u) -eq 0 ]] || die "must run as root"
    for c in slurmctld slurmd sinfo munged nsenter; do
        command -v "$c" >/dev/null || die "$c missing: apt-get install -y slurmctld slurmd slurm-client munge libpmix-dev"
    done
    if [[ -f $DIR/n && $(cat "$DIR/n") == "$n" && -n $(our_pids slurmctld) && $(n_idle) -ge 1 ]]; then
        note "already up with $n nodes"; sinfo; return 0
    fi
    [[ -d $DIR ]] && { note "stale or different cluster in $DIR: taking it down first"; down; }
    mkdir -p "$DIR/ctld" "$DIR/munge" "$DIR/munge-run"
    chmod 700 "$DIR/munge"; chmod 755 "$DIR" "$DIR/munge-run"  # munged: key dir private, socket dir o+x
    echo "$n" >"$DIR/n"

    # 1. namespaces (reuse them if h0..h(N-1) are there already, e.g. made by someone else)
    local have=1
    for ((i = 0; i < n; i++)); do [[ -e /run/netns/h$i ]] || have=0; done
    if [[ $have == 1 ]] && ip link show brpi >/dev/null 2>&1; then
        note "reusing namespaces h0..h$((n - 1)) (not created here: down leaves them)"
    else
        [[ -x $NETNS_CLUSTER || -f $NETNS_CLUSTER ]] || die "no $NETNS_CLUSTER (set NETNS_CLUSTER)"
        touch "$DIR/netns-owned"
        # its MPI probe after up (python -m pipeinfer.wire.netprobe, run from the checkout so that pipeinfer imports)
        # may fail (no pipeinfer venv active, or Open MPI's mpiexec first on PATH): harmless here
        (cd "$(dirname "$NETNS_CLUSTER")/../.." && bash "$NETNS_CLUSTER" up "$n") || note "netns-cluster.sh up returned non-zero (its MPI probe?); checking the namespaces"
        for ((i = 0; i < n; i++)); do [[ -e /run/netns/h$i ]] || die "namespace h$i missing after netns-cluster.sh up"; done
    fi

    # 2. munge: own key and socket; a unix socket by path is reachable from every network namespace
    [[ -f $DIR/munge/munge.key ]] || { dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 2>/dev/null; chmod 400 "$DIR/munge/munge.key"; }
    munged --socket="$SOCK" --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge-run/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed" || die "munged failed: $(tail -2 "$DIR/munge/munged.log")"
    munge -S "$SOCK" -n | unmunge -S "$SOCK" >/dev/null || die "munge self-test failed"
    ip netns exec h0 sh -c "munge -S '$SOCK' -n | unmunge -S '$SOCK' >/dev/null" || die "munge not reachable from h0"

    # 3. slurm.conf, slurmctld (root namespace, reachable on 10.77.0.254), one slurmd per namespace
    write_conf "$n"
    slurmctld -c -i || die "slurmctld failed: $(tail -3 "$DIR/slurmctld.log")"
    for k in $(seq 50); do scontrol ping 2>/dev/null | grep -q UP && break; sleep 0.2; done
    for ((i = 0; i < n; i++)); do
        nsenter --net="/run/netns/h$i" slurmd -N "h$i" || die "slurmd h$i failed: $(tail -3 "$DIR/slurmd-h$i.log")"
    done
    for k in $(seq 120); do
        [[ $(n_idle) -eq $n ]] && break
        sleep 0.5
    done
    [[ $(n_idle) -eq $n ]] || { sinfo; die "only $(n_idle) of $n nodes idle after 60 s (logs in $DIR)"; }
    sinfo
    note "up: $n nodes in $((SECONDS - t0)) s; now: export SLURM_CONF=$CONF"
}

down() {
    local p pids
    if [[ -f $CONF ]] && [[ -n $(our_pids slurmctld) ]]; then
        pids=$(squeue -h -o %i 2>/dev/null)
        [[ -n $pids ]] && { scancel $pids 2>/dev/null; sleep 1; }
    fi
    stop_pids $(our_pids slurmd)
    stop_pids $(our_pids slurmstepd)
    stop_pids $(our_pids slurmctld)   # its slurmscriptd child goes with it
    stop_pids $(munged_pid)
    if [[ -f $DIR/netns-owned ]]; then
        bash "$NETNS_CLUSTER" down
    fi
    rm -rf "$DIR"
    note "down: daemons stopped, $DIR removed"
}

status() {
    echo "slurmctld: $(our_pids slurmctld | paste -sd' ')  slurmd: $(our_pids slurmd | paste -sd' ')  munged: $(munged_pid)"
    [[ -f $CONF ]] && sinfo
}

case ${1:-} in
    up) [[ $# -eq 2 ]] || die "usage: $0 up N"; up "$2" ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up N | down | status" >&2; exit 2 ;;
esac
