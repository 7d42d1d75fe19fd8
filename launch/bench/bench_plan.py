"""`pipeinfer plan --machines` against real runs: this machine described by its cores, RAM and disk, the plan's
command for each mode run for real, predicted and measured tokens/s side by side in one run.

    python launch/bench/bench_plan.py [--ranks 2 3] [--rounds 2] [-n 128] [--profile P] [--out results/bench_plan.csv]

For each rank count, a hostfile `localhost:N # pipeinfer: cores=C mem=M disk=D` (this machine's); plan's search
(twin/plan.search on twin/machines.described_profile, calibrated on --profile: default the one pipeinfer ships,
which must have been measured on this machine for the check to mean anything) picks each mode's configuration;
that mode's `pipeinfer launch --hostfile H -- generate ...` line runs with the code prompt, --ignore-eos, -n tokens,
rounds in alternating order; the median measured tokens/s over the prediction is printed. 2 ranks x 1 thread use
this machine's 2 cores; 3 ranks x 1 thread oversubscribe them (the plan knows: a machine of 2 cores runs 3 ranks).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path()
import quiet  # noqa: E402

from pipeinfer.engine.models import resolve_model  # noqa: E402
from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.twin.machines import N_CTX, target_from_gguf  # noqa: E402
from pipeinfer.twin.plan import (  # noqa: E402
    REFERENCE_PROFILE,
    describe,
    launch_line,
    load_profile,
    search,
)

BIN = Path(sys.executable).parent


def this_machine(slots: int) -> str:
    mem_gib = int(Path("/proc/meminfo").read_text().split()[1]) / (1 << 20)
    disk_gib = shutil.disk_usage(Path.home()).free / (1 << 30)
    return f"localhost:{slots} # pipeinfer: cores={os.cpu_count()} mem={mem_gib:.0f} disk={disk_gib:.0f}\n"


def run(line: str, n: int) -> float:
    argv = shlex.split(line)[1:]  # without the leading 'pipeinfer'
    cmd = [str(BIN / "python"), "-m", "pipeinfer", *argv, "--prompt-name", "code", "-n", str(n), "--ignore-eos",
           "--json", "-q"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=dict(os.environ, **quiet.OWN_ENV))
    if p.returncode:
        raise SystemExit(f"{line}: exit {p.returncode}: {p.stderr.strip()[-600:]}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    return float(out["stats"]["gen_tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--modes", nargs="+", default=["iterative", "speculative", "pipeinfer"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--profile", default=str(REFERENCE_PROFILE))
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_plan.csv"))
    a = ap.parse_args()
    prof = load_profile(a.profile)
    model = str(resolve_model("qwen2.5-coder-1.5b"))
    target = target_from_gguf(model)
    rows = []
    for n_ranks in a.ranks:
        hosts = Path(tempfile.mkstemp(suffix=".hosts")[1])
        hosts.write_text(this_machine(n_ranks))
        d = describe(str(hosts), target, prof, n_ctx=N_CTX, latency_us=0.0,
                     draft_bytes=float(prof["draft"].get("file_bytes", 0.0)))
        best = search(d.profile, agreement=0.7, n_predict=a.n, exact_limit=int(d.profile["exact_batch"]),
                      draft_own_host=False, base=GenConfig(stop_at_eos=False),
                      confidence=d.profile["draft"].get("confidence"), split_ok=d.split_ok)
        measured: dict[str, list[float]] = {m: [] for m in a.modes}
        lines = {m: launch_line(d.profile, best[m], str(hosts), model) for m in a.modes}
        for i in range(a.rounds):
            for mode in (a.modes if i % 2 == 0 else list(reversed(a.modes))):
                measured[mode].append(run(lines[mode], a.n))
                print(f"{n_ranks} ranks, {mode}: {measured[mode][-1]:.2f} tokens/s", flush=True)
        for mode in a.modes:
            real, predicted = statistics.median(measured[mode]), best[mode].tokens_per_s
            rows.append({"ranks": n_ranks, "mode": mode, "predicted_tokens_per_s": round(predicted, 3),
                         "measured_tokens_per_s": round(real, 3), "measured_over_predicted": round(real / predicted, 3),
                         "rounds": a.rounds, "n_predict": a.n, "command": lines[mode]})
        hosts.unlink()
    write_csv(a.out, rows)
    print(f"{'ranks':>5} {'mode':<12} {'predicted':>10} {'measured':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['ranks']:>5} {r['mode']:<12} {r['predicted_tokens_per_s']:>10.2f} {r['measured_tokens_per_s']:>10.2f} "
              f"{r['measured_over_predicted']:>6.2f}")
    worst = max(abs(r["measured_over_predicted"] - 1) for r in rows)
    print(f"largest difference: {100 * worst:.0f}% ({'within' if worst <= 0.2 else 'outside'} 20%); written to {a.out}")


if __name__ == "__main__":
    main()
