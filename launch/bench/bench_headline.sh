#!/usr/bin/env bash
# Re-take every number docs/benchmarks.md quotes, in one sitting, on one machine, from one commit.
#
#     bash launch/bench/bench_headline.sh [STEP...]   # steps: profile peers repeat serve lost weights lost-weights cache
#                                               #        twin groups failures
#
# Each step waits for a quiet machine (launch/quiet.py) and writes its files into results/. results/sitting.txt
# gets the machine and, for each step, the commit it ran at, its command and its wall time (a run of all steps
# starts the file afresh; named steps are appended to it). About 100 minutes on 2 cores; `weights`, `lost`, `lost-weights` and
# the `1gbit` rows of `peers` need root (the emulated cluster).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=results/sitting.txt
if [[ -n $(git status --porcelain -- pipeinfer launch) ]]; then
    echo "bench_headline: pipeinfer/ or launch/ has uncommitted changes: the numbers would carry no commit" >&2
    exit 1
fi
if [[ $# -eq 0 || ! -f $OUT ]]; then
    {
        echo "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(free -g | awk '/Mem:/{print $2}') GiB"
        echo "llama-cpp-python: $(python -c 'import llama_cpp; print(llama_cpp.__version__)')"
    } > "$OUT"
fi
STEPS=${*:-profile peers repeat serve lost weights lost-weights cache twin groups failures}
COMMIT=$(git rev-parse --short HEAD)

quiet() { python -c "import sys; sys.path.insert(0, 'launch'); import quiet; quiet.wait_quiet()"; }
step() {
    local name=$1; shift
    local t0=$SECONDS start
    start=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    echo "[sitting] $name: $*"
    quiet
    "$@"
    echo "$name: commit $COMMIT, started $start, $((SECONDS - t0)) s: $*" >> "$OUT"
}

for s in $STEPS; do
    case $s in
    profile) step profile mpiexec -n 2 pipeinfer profile -t 1 -o results/twin_profile_2ranks.json ;;
    peers)   step peers python launch/bench/bench_peers.py --rounds 3 -n 128 --networks local,1gbit ;;
    repeat)  step repeat python launch/bench/bench_repeat.py -n 128 --prompts code,story --repeats 3 ;;
    serve)   step serve python launch/bench/serve_load.py --rounds 2 ;;
    lost)    step lost python launch/bench/serve_load.py --netns 3 --config '--hostfile {hosts} --stall-timeout 10' \
                 --kill-rank 2 --fault cut --out results/serve_lost_host.csv ;;
    weights) step weights python launch/bench/bench_weights.py ;;
    lost-weights) step lost-weights python launch/bench/serve_load.py --netns 3 \
                 --config '--hostfile {hosts} --stall-timeout 10 {own-disks}' \
                 --config '--hostfile {hosts} --stall-timeout 10 {model-on-h0}' \
                 --kill-rank 2 --fault cut --out results/serve_lost_weights.csv ;;
    cache)   step cache python launch/bench/bench_prompt_cache.py --conversations 3 --turns 4 --user-tokens 200 \
                 --max-tokens 32 ;;
    twin)    step twin python launch/twin/twin_scaling.py --profile results/twin_profile_2ranks.json
             step trees python launch/twin/twin_trees.py --profile results/twin_profile_2ranks.json ;;
    groups)  step groups python launch/bench/bench_groups.py -n 128 --prompts code,story --repeats 3 --links local,1gbit
             step group-agreement python launch/bench/group_agreement.py -n 512
             step group-serving python launch/bench/bench_serving.py --clients 8,16 --rounds 2 \
                 --systems llama-server,llama-rpc,pipeinfer,group --system 'group=pipeinfer --tensor-parallel 2' \
                 --out results/bench_serving_groups
             step twin-groups python launch/twin/twin_groups.py ;;
    failures) step failures python launch/bench/failures.py --mpi mpich openmpi ;;
    *) echo "bench_headline: unknown step $s" >&2; exit 2 ;;
    esac
done
