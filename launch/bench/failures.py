#!/usr/bin/env python
"""What the user sees for each fault and bad input: the table of docs/failures.md, measured.

    python launch/bench/failures.py [--out results/failures] [--only NAME ...] [--mpi mpich openmpi]

The cases (tests/faults.py, run as a program: this script never imports the tests) run the real CLI under mpiexec on small synthetic GGUFs and record
the exit code, the seconds from the fault (or from the start, for bad input) to the end of mpiexec, the first
`pipeinfer: error` line, whether the text so far was on stdout, what --results got and when the last rank process
of the job was gone; the emulated cluster's rows (launch/cluster/netns-cluster.sh) need root and are skipped with a note
elsewhere. Writes OUT.csv and OUT.md (a markdown table) and prints the table; with --only, the named rows are
measured again and the others kept from OUT.csv. tests/test_failures.py runs the same cases and checks each
row's expectation.

--mpi picks the MPIs each case runs under (the table's MPI column): `mpich`, the mpich wheel's mpiexec (the
default), and `openmpi`, Open MPI's mpirun with mpi4py loading Open MPI's library (MPI4PY_MPIABI=openmpi, as
docs/cluster.md sets it up; needs openmpi-bin). The emulated cluster's row runs under MPICH only.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, netns_unavailable, write_csv  # noqa: E402

FAULTS = [sys.executable, str(ROOT / "tests" / "faults.py")]


def _faults(*args: str) -> dict:
    """tests/faults.py's answer (one JSON object on stdout) to these arguments."""
    p = subprocess.run(FAULTS + list(args), capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"failures: tests/faults.py {' '.join(args)} failed: {p.stderr.strip()[-1500:]}")
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else {}

COLS = ["case", "mpi", "what", "exit_code", "seconds", "from", "error", "n_error_lines", "traceback",
        "stdout_bytes_at_fault", "stdout_bytes", "results_status", "n_generated", "reform", "ranks_gone_s", "test"]
MPI_LABEL = {"mpich": "MPICH", "openmpi": "Open MPI"}


def _table(rows: list[dict]) -> str:
    lines = ["| fault or input | MPI | what the user sees (first error line) | exit code | time to exit (s) | "
             "text and --results row |", "|---|---|---|---|---|---|"]
    for r in rows:
        kept = ""
        if r["from"] == "fault":
            kept = (f"{r['stdout_bytes']} bytes of text on stdout; row: " +
                    (f"`{r['results_status'][:24]}...`" if r["results_status"] else "none"))
            if r.get("ranks_gone_s") and not r.get("reform"):  # (a resumed run's ranks end with the answer)
                kept += f"; every rank process gone {r['ranks_gone_s']} s after the fault"
        when = f"{r['seconds']} after the fault" if r["from"] == "fault" else f"{r['seconds']} from start"
        err = r["error"].replace("|", "\\|") or "(none: mpiexec's BAD TERMINATION notice)"
        if r.get("reform") and str(r["exit_code"]) == "0":  # a supervised run went on: its re-form line
            err = "(no error) " + r["reform"]
            when += " (the whole answer)"
        mpi = MPI_LABEL.get(r.get("mpi") or "mpich", r.get("mpi"))
        lines.append(f"| {r['what']} | {mpi} | `{err}` | {r['exit_code']} | {when} | {kept} |")
    return "\n".join(lines)


def _old_rows(out: str) -> dict[tuple[str, str], dict]:
    """OUT.csv's rows by (case name, MPI): what a row not measured this time (--only, --mpi, or skipped) keeps;
    a file from before the MPI column holds MPICH's rows."""
    try:
        with open(out + ".csv", newline="") as f:
            return {(r["case"], r.get("mpi") or "mpich"): dict(r, mpi=r.get("mpi") or "mpich")
                    for r in csv.DictReader(f)}
    except FileNotFoundError:
        return {}


def _measure(case: dict, models: Path, work: Path, mpi: str) -> dict | None:
    """One case's row under one MPI (case: tests/faults.py --list's entry), or None when it cannot run here."""
    why = netns_unavailable() if case["netns"] else None
    if case["netns"] and mpi != "mpich":
        why = "the emulated cluster runs MPICH's mpiexec only"
    if why:
        print(f"{case['name']} ({mpi}): skipped ({why}); its row is kept from the last run", file=sys.stderr,
              flush=True)
        return None
    tmp = work / f"{case['name']}-{mpi}"
    tmp.mkdir()
    r = _faults("--measure", case["name"], "--mpi", mpi, "--models", str(models), "--work", str(tmp))
    r["test"] = case["test"]
    print(f"{case['name']} ({mpi}): exit {r['exit_code']} in {r['seconds']} s: {r['error'][:150]}", file=sys.stderr,
          flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "failures"))
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="measure these cases only (CASES' names)")
    known = _faults("--list")
    cases, mpis = known["cases"], known["mpis"]
    ap.add_argument("--mpi", nargs="+", choices=mpis, default=["mpich"], help="the MPIs to measure under")
    a = ap.parse_args()
    unknown = set(a.only or []) - {c["name"] for c in cases}
    if unknown:
        ap.error(f"no case named {', '.join(sorted(unknown))} (known: {', '.join(c['name'] for c in cases)})")
    work = Path(tempfile.mkdtemp(prefix="pipeinfer-failures-"))
    os.environ.setdefault("PIPEINFER_STAGE_CACHE", str(work / "stages"))
    try:
        _faults("--models", str(work / "models"))
        measured = {(c["name"], mpi): _measure(c, work / "models", work, mpi) for c in cases for mpi in a.mpi
                    if not a.only or c["name"] in a.only}
        old = _old_rows(a.out)
        keys = [(c["name"], mpi) for c in cases for mpi in mpis]  # each case's MPICH row, then its Open MPI row
        rows = [measured.get(k) or old[k] for k in keys if measured.get(k) or k in old]
        write_csv(a.out + ".csv", rows, COLS, extrasaction="ignore")
        table = _table(rows)
        Path(a.out + ".md").write_text(table + "\n")
        print(table)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
