#!/usr/bin/env bash
# Reproduce the paper's comparison (iterative -> speculative -> pipeinfer, per prompt) on the models this
# project can get (pipeinfer models fetch --all), writing one CSV and the plots.
#
#   launch/bench/experiments.sh [RANKS] [N_TOKENS]        (defaults: 2 ranks, 128 tokens)
#
# Target: Qwen2.5-Coder-1.5B. Drafters: the n-gram drafter (no model), Gemma 3 270M drafting through
# text translation (its vocabulary differs from Qwen's), and the replay drafter (a
# benchmark instrument: replays the target's own earlier output at a set accuracy while spending
# Gemma 3 270M's compute per draft token) at 0.8 and 0.5 accuracy, standing in for the paper's model
# pairs of different acceptance. On a 2-core machine keep ranks x threads <= 2 (default: 1 thread
# per rank). Results: results/results.csv (appended) and results/*.png.
# Subsets: PROMPTS="code story encyclopedia", DRAFTERS="ngram gemma replay", REPLAY_ACCURACIES="0.8 0.5";
# REPLAY_P_ACCEPT (default 0.5) is the cutoff for the replay drafter, whose confidence is its accuracy.
set -euo pipefail
cd "$(dirname "$0")/../.."
RANKS=${1:-2}
N=${2:-128}
THREADS=${THREADS:-1}
OUT=${OUT:-results}
CSV="$OUT/results.csv"
MPIEXEC=${MPIEXEC:-$(dirname "$(command -v python)")/mpiexec}
PI=(python -m mpi4py -m pipeinfer)
mkdir -p "$OUT"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

PROMPTS=${PROMPTS:-code story encyclopedia}
DRAFTERS=${DRAFTERS:-ngram gemma replay}
has() { [[ " $DRAFTERS " == *" $1 "* ]]; }

for prompt in $PROMPTS; do
    echo "== $prompt: reference run (iterative, JSON kept for the replay drafter)"
    "$MPIEXEC" -n "$RANKS" "${PI[@]}" generate --prompt-name "$prompt" -n "$N" --mode iterative -t "$THREADS" \
        --ignore-eos --json -q --results "$CSV" > "$tmp/$prompt.json"
    for mode in speculative pipeinfer; do
        if has ngram; then
            echo "== $prompt: $mode, n-gram drafter"
            "$MPIEXEC" -n "$RANKS" "${PI[@]}" generate --prompt-name "$prompt" -n "$N" --mode "$mode" -t "$THREADS" \
                --drafter ngram --ignore-eos -q --results "$CSV" > /dev/null
        fi
        if has gemma; then
            echo "== $prompt: $mode, Gemma 3 270M draft through text translation"
            "$MPIEXEC" -n "$RANKS" "${PI[@]}" generate --prompt-name "$prompt" -n "$N" --mode "$mode" -t "$THREADS" \
                --draft gemma3-270m --p-accept 0.3 --ignore-eos -q --results "$CSV" > /dev/null
        fi
        has replay || continue
        for acc in ${REPLAY_ACCURACIES:-0.8 0.5}; do
            echo "== $prompt: $mode, replay drafter at $acc (Gemma 3 270M compute)"
            "$MPIEXEC" -n "$RANKS" "${PI[@]}" generate --prompt-name "$prompt" -n "$N" --mode "$mode" -t "$THREADS" \
                --drafter replay --replay-ref "$tmp/$prompt.json" --replay-accuracy "$acc" --draft gemma3-270m \
                --p-accept "${REPLAY_P_ACCEPT:-0.5}" --ignore-eos -q --results "$CSV" > /dev/null
        done
    done
done
pipeinfer plot "$CSV" -o "$OUT"
echo "results: $CSV and $OUT/*.png"
