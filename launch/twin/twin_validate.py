#!/usr/bin/env python3
"""Benchmark (not a test): the digital twin's predictions beside measured runs, in one script run.

    python launch/twin/twin_validate.py [-n 128] [--prompt-name code] [--netns] [--out results/twin_validation.csv]

1. profiles this machine (`pipeinfer profile`, 2 ranks x 1 thread: stage costs by batch size, the Gemma
   draft's cost per token, the link),
2. measures iterative, speculative and pipeinfer on the real Qwen2.5-Coder-1.5B target, with the replay
   drafter at agreement 0.5, 0.7, 0.9 (Gemma 3 270M's compute per draft token) and with the Gemma draft,
3. simulates each run with the real scheduler on the profile (same reference tokens, same agreement
   draws; the Gemma rows use the measured acceptance as the agreement) and writes predicted beside
   measured tokens/s and the error.
With --netns it repeats 1-3 on launch/cluster/netns-cluster.sh: 3 hosts, links shaped to 100 Mbit/s (root only).
Timing runs keep ranks x threads within this machine's 2 cores (the 3-host cluster oversubscribes them:
its rows say so).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import CLUSTER, MPIEXEC, ROOT, on_path, pipeinfer_cmd  # noqa: E402

on_path()
BIN = Path(sys.executable).parent
PI = pipeinfer_cmd()

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, launch_line, load_profile, search  # noqa: E402
from pipeinfer.twin.sim import simulate  # noqa: E402
from quiet import run_quietly  # noqa: E402

FIELDS = ["setup", "mode", "drafter", "agreement", "draft_max", "measured_tokens_per_s", "predicted_tokens_per_s",
          "error_pct", "measured_acceptance", "predicted_acceptance", "measured_runs", "predicted_runs",
          "measured_cancelled", "predicted_cancelled", "foreign_cpu_pct"]


class Setup:
    def __init__(self, name: str, n_ranks: int, netns_rate: str | None, threads: str):
        self.name, self.n_ranks, self.rate, self.threads = name, n_ranks, netns_rate, threads

    def run(self, args: list[str]) -> str:
        """stdout of `pipeinfer ARGS` on this setup's ranks, measured while the machine is otherwise quiet
        (quiet.py); self.foreign_pct: other processes' CPU during it."""
        if self.rate is None:
            cmd = [MPIEXEC, "-n", str(self.n_ranks)] + PI + args
            env = None
        else:
            env = dict(os.environ, NETNS_RATE=self.rate, MPIEXEC=MPIEXEC, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
            cmd = ["bash", str(CLUSTER / "netns-cluster.sh"), "run", str(self.n_ranks), "--"] + PI + args
        p, self.foreign_pct = run_quietly(cmd, env=env, cwd=ROOT)
        if p.returncode != 0:
            raise SystemExit(f"[{self.name}] pipeinfer {' '.join(args)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        return p.stdout


def drafter_args(drafter: str, agreement: float | None, ref: Path) -> list[str]:
    if drafter == "gemma":
        return ["--draft", "gemma3-270m"]
    return ["--drafter", "replay", "--replay-ref", str(ref), "--replay-accuracy", str(agreement),
            "--draft", "gemma3-270m"]


def measure(setup: Setup, n: int, prompt_name: str, tmp: Path, log, prof_path: Path, meas_path: Path,
            runs_too: bool = True) -> None:
    """Profile, then every measured run; saved to prof_path and meas_path (predict() reads them)."""
    log(f"[{setup.name}] profiling -> {prof_path}")
    setup.run(["profile", "-t", "1", "-o", str(prof_path)])
    if not runs_too:
        return
    # the twin's head placement is the draft in series with rank 0's stage (--draft-at head)
    base = ["generate", "--prompt-name", prompt_name, "-n", str(n), "-t", setup.threads, "--ignore-eos", "--json", "-q",
            "--draft-at", "head"]
    ref = tmp / f"ref-{meas_path.stem}.json"
    log(f"[{setup.name}] iterative")
    out = setup.run(base + ["--mode", "iterative"])
    ref.write_text(out.strip().splitlines()[-1])
    ref_data = json.loads(ref.read_text())
    runs = [{"mode": "iterative", "drafter": "none", "agreement": None, "stats": ref_data["stats"],
             "foreign_cpu_pct": setup.foreign_pct}]
    for drafter, agreement in [("replay", 0.5), ("replay", 0.7), ("replay", 0.9), ("gemma", None)]:
        for mode in ("speculative", "pipeinfer"):
            log(f"[{setup.name}] {mode} {drafter} {agreement or ''}")
            out = setup.run(base + ["--mode", mode] + drafter_args(drafter, agreement, ref))
            runs.append({"mode": mode, "drafter": drafter, "agreement": agreement,
                         "stats": json.loads(out.strip().splitlines()[-1])["stats"], "foreign_cpu_pct": setup.foreign_pct})
    meas_path.write_text(json.dumps({"setup": setup.name, "n": n, "prompt_name": prompt_name,
                                     "prompt_tokens": ref_data["prompt_tokens"], "tokens": ref_data["tokens"],
                                     "runs": runs}, indent=0))


def predict(prof_path: Path, meas_path: Path, log) -> list[dict]:
    """The twin's prediction for every measured run, beside it."""
    prof = load_profile(str(prof_path))
    data = json.loads(meas_path.read_text())
    reference = list(data["prompt_tokens"]) + list(data["tokens"])
    limit = int(prof.get("exact_batch", 3))
    rows = []
    for run in data["runs"]:
        mode, drafter, agreement, st = run["mode"], run["drafter"], run["agreement"], run["stats"]
        draft_max = 1 if mode == "iterative" else (limit - 1 if mode == "speculative" else limit)
        agree = agreement if agreement is not None else st["acceptance_rate"]
        # the replay instrument burns the draft model's plain decodes; the Gemma draft runs translated
        cluster = build_cluster(prof, Shape(draft_ms=prof["draft"]["ms_per_token"] if drafter == "replay" else None))
        gen = GenConfig(mode=mode, n_predict=data["n"], draft_max=draft_max, p_recovery=None,
                        stop_at_eos=False)
        # the replay drafter always proposes; the Gemma draft as the profile measured it (its confidence and
        # agreement along the target's output: nothing taken from the run predicted), else the run's own rates
        propose = 1.0 if drafter != "gemma" else st["n_spec_runs"] / max(1, st["n_draft_calls"])
        conf = prof["draft"].get("confidence") if drafter == "gemma" else None
        res = simulate(cluster, gen, agreement=agree, reference=reference, n_prompt=len(data["prompt_tokens"]),
                       propose=propose, confidence=conf)
        meas, pred = st["gen_tokens_per_s"], res.stats.gen_tokens_per_s
        rows.append({"setup": data["setup"], "mode": mode, "drafter": drafter, "agreement": agreement or "",
                     "draft_max": draft_max if mode != "iterative" else "", "measured_tokens_per_s": round(meas, 3),
                     "predicted_tokens_per_s": round(pred, 3), "error_pct": round(100 * (pred - meas) / meas, 1),
                     "measured_acceptance": round(st["acceptance_rate"], 3),
                     "predicted_acceptance": round(res.stats.acceptance_rate, 3),
                     "measured_runs": st["n_runs"], "predicted_runs": res.stats.n_runs,
                     "measured_cancelled": st["n_cancelled"], "predicted_cancelled": res.stats.n_cancelled,
                     "foreign_cpu_pct": run["foreign_cpu_pct"]})
        log(f"  {mode:<12} {drafter:<7} {agreement or '':<4} measured {meas:6.2f}  predicted {pred:6.2f} tokens/s "
            f"({rows[-1]['error_pct']:+.1f}%)")
    return rows


PLAN_CHECK_ROUNDS = 2


def check_plan(setup: Setup, prof_path: Path, meas_path: Path, log) -> dict:
    """`pipeinfer plan` on the profile, at the Gemma draft's measured acceptance: measure what it recommends
    and compare with the best configuration measured with the same draft (or none)."""
    prof = load_profile(str(prof_path))
    data = json.loads(meas_path.read_text())
    gemma = [r for r in data["runs"] if r["drafter"] in ("gemma", "none")]
    st_pi = next(r["stats"] for r in gemma if r["mode"] == "pipeinfer")
    agreement = st_pi["acceptance_rate"]
    propose = st_pi["n_spec_runs"] / max(1, st_pi["n_draft_calls"])   # as predict() gives the Gemma rows
    conf = prof["draft"].get("confidence")   # the profile's measured draft: plan chooses -pa as well
    best = search(prof, agreement=agreement, n_predict=data["n"], exact_limit=int(prof.get("exact_batch", 3)),
                  draft_own_host=False, base=GenConfig(stop_at_eos=False), propose=propose, confidence=conf)
    win = max(best.values(), key=lambda c: c.tokens_per_s)
    line = launch_line(prof, win)
    draft = ("the profile's measured draft" if conf else
             f"agreement {agreement:.2f}, proposing at {propose:.2f} of calls")
    log(f"[{setup.name}] plan with {draft} recommends: {line} ({win.tokens_per_s:.2f} tokens/s predicted)")
    args = line.split(" -- ", 1)[1].split()
    args += ["--prompt-name", data["prompt_name"], "-n", str(data["n"]), "--ignore-eos", "--json", "-q"]
    if win.mode != "iterative":
        args += ["--draft", "gemma3-270m"]
    best_measured = max(gemma, key=lambda r: r["stats"]["gen_tokens_per_s"])
    best_args = ["generate", "--prompt-name", data["prompt_name"], "-n", str(data["n"]), "-t", setup.threads,
                 "--ignore-eos", "--json", "-q", "--draft-at", "head", "--mode", best_measured["mode"]]
    if best_measured["drafter"] == "gemma":
        best_args += ["--draft", "gemma3-270m"]
    # this machine's speed drifts by 10-30% over tens of minutes: the recommendation and the best configuration
    # of the validation run are measured again side by side, alternating, and compared with each other
    rec, best_again = [], []
    for _ in range(PLAN_CHECK_ROUNDS):
        rec.append(json.loads(setup.run(args).strip().splitlines()[-1])["stats"]["gen_tokens_per_s"])
        best_again.append(json.loads(setup.run(best_args).strip().splitlines()[-1])["stats"]["gen_tokens_per_s"])
    ratio = sum(rec) / sum(best_again)
    log(f"  measured {', '.join(f'{x:.2f}' for x in rec)} tokens/s; best configuration of the validation run "
        f"({best_measured['mode']}, {best_measured['stats']['gen_tokens_per_s']:.2f} then) alternating with it: "
        f"{', '.join(f'{x:.2f}' for x in best_again)} -> {ratio:.3f}")
    st = {"gen_tokens_per_s": sum(rec) / len(rec)}
    return {"setup": setup.name, "rounds": PLAN_CHECK_ROUNDS, "best_alternating_tokens_per_s": [round(x, 3) for x in best_again],
            "recommended_tokens_per_s": [round(x, 3) for x in rec], "draft": "measured by the profile" if conf else "the run's acceptance and proposal rate",
            "agreement": round(agreement, 3), "propose": round(propose, 3), "recommended": line,
            "predicted_tokens_per_s": round(win.tokens_per_s, 3), "measured_tokens_per_s": round(st["gen_tokens_per_s"], 3),
            "best_measured_mode": best_measured["mode"],
            "best_measured_tokens_per_s": round(best_measured["stats"]["gen_tokens_per_s"], 3),
            "ratio_to_best": round(ratio, 3)}   # recommended / best, measured alternately


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("--prompt-name", default="code")
    ap.add_argument("--netns", action="store_true", help="also the 3-host cluster with 100 Mbit/s links (root)")
    ap.add_argument("--netns-only", action="store_true")
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_validation.csv"))
    ap.add_argument("--predict-only", action="store_true",
                    help="no measuring: predict again from the profile and runs an earlier run saved beside --out")
    ap.add_argument("--profile-only", action="store_true", help="profile again, then predict the saved runs")
    ap.add_argument("--plan-check", choices=["yes", "no", "only"], default="yes",
                    help="measure what `pipeinfer plan` recommends on the 2-rank profile (only: just that, on saved runs)")
    args = ap.parse_args()
    setups = []
    if not args.netns_only:
        setups.append(Setup("2 ranks local", 2, None, "1"))
    if args.netns or args.netns_only:
        setups.append(Setup("3 hosts 100 Mbit/s", 3, "100mbit", "1"))
    t0 = time.time()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for s in setups:
            slug = "2ranks" if s.rate is None else f"{s.n_ranks}hosts-{s.rate}"
            prof = Path(args.out).with_name(f"twin_profile_{slug}.json")
            meas = Path(args.out).with_name(f"twin_measured_{slug}.json")
            if not args.predict_only and args.plan_check != "only":
                measure(s, args.n, args.prompt_name, Path(tmp), lambda m: print(m, flush=True), prof, meas,
                        runs_too=not args.profile_only)
            print(f"[{s.name}] the twin's predictions")
            rows += predict(prof, meas, lambda m: print(m, flush=True))
            if s.rate is None and (args.plan_check == "only" or (args.plan_check == "yes" and not args.predict_only)):
                plan_row = check_plan(s, prof, meas, lambda m: print(m, flush=True))
                Path(args.out).with_name("twin_plan_check.json").write_text(json.dumps(plan_row, indent=1) + "\n")
    out = Path(args.out)
    keep = []
    if out.exists():  # rows of the other setups from an earlier run stay
        names = {s.name for s in setups}
        keep = [r for r in csv.DictReader(out.open()) if r["setup"] not in names]
    with out.open("w", newline="") as f:
        w = csv.DictWriter(f, FIELDS)
        w.writeheader()
        w.writerows(keep + rows)
    for s in setups:
        errs = [abs(r["error_pct"]) for r in rows if r["setup"] == s.name]
        print(f"{s.name}: largest error {max(errs):.1f}% over {len(errs)} rows")
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
