#!/usr/bin/env bash
# Benchmark (not a test): PipeInfer's recovery factor (-pr) against synchronous speculation and iterative
# inference, side by side in one run, on the real Qwen2.5-Coder-1.5B with 2 ranks x 1 thread.
#
#   launch/bench_recovery.sh [N_TOKENS] [PR_VALUES]     (defaults: 128, "0.1 auto")
#
# Drafters: the replay instrument at agreement 0.5, 0.7, 0.9 (Gemma 3 270M's compute per draft token) and
# the Gemma 3 270M draft through text translation. Rows go to $OUT/bench_recovery.csv (default results/);
# the summary prints each configuration's speed as a ratio of iterative's and of speculative's.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-128}
PRS=${2:-0.1 auto}
OUT=${OUT:-results}
CSV="$OUT/bench_recovery.csv"
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v python)")/mpiexec}
PI=(python -m mpi4py -m pipeinfer)
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
first=1  # lines in the CSV before this run (header included)
[[ -f $CSV ]] && first=$(wc -l < "$CSV")

gen() { "$MPIEXEC" -n 2 "${PI[@]}" generate --prompt-name code -n "$N" -t 1 --ignore-eos -q --results "$CSV" "$@"; }
draft_args() {
    case $1 in
        gemma) echo "--draft gemma3-270m -pa 0.3" ;;
        *) echo "--drafter replay --replay-ref $tmp/ref.json --replay-accuracy $1 --draft gemma3-270m -pa 0.5" ;;
    esac
}

echo "== iterative (reference for the replay drafter)"
gen --mode iterative --json > "$tmp/ref.json"
for d in 0.5 0.7 0.9 gemma; do
    echo "== $d: speculative"
    # shellcheck disable=SC2046
    gen --mode speculative $(draft_args "$d") > /dev/null
    for pr in $PRS; do
        echo "== $d: pipeinfer -pr $pr"
        # shellcheck disable=SC2046
        gen --mode pipeinfer -pr "$pr" $(draft_args "$d") > /dev/null
    done
done

python - "$CSV" "$first" "$PRS" <<'EOF'
import csv, sys
path, first, prs = sys.argv[1], int(sys.argv[2]), sys.argv[3].split()
rows = list(csv.DictReader(open(path)))[max(0, first - 1):]
it = float(next(r for r in rows if r["mode"] == "iterative")["gen_tokens_per_s"])
spec_rows = [r for r in rows if r["mode"] == "speculative"]
pipe_rows = [r for r in rows if r["mode"] == "pipeinfer"]
print(f"iterative {it:.2f} tokens/s (2 ranks x 1 thread)")
for k, s in enumerate(spec_rows):
    sp = float(s["gen_tokens_per_s"])
    print(f"{s['draft_model']:>12}: speculative {sp:.2f} ({sp / it:.2f}x iterative), TTFT {float(s['ttft_s']):.2f} s")
    for pr, p in zip(prs, pipe_rows[k * len(prs):(k + 1) * len(prs)]):
        v = float(p["gen_tokens_per_s"])
        print(f"{'':>12}  pipeinfer -pr {pr:<5} {v:.2f} ({v / it:.2f}x iterative, {v / sp:.2f}x speculative), "
              f"TTFT {float(p['ttft_s']):.2f} s, runs {p['n_runs']} ({p['n_cancelled']} cancelled)")
EOF
