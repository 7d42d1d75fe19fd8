"""The failure table of docs/failures.md as cases: what the user sees for each fault and bad input.

Each case runs the real CLI under mpiexec on small synthetic GGUFs (synth.py) and records the exit code, the
seconds from the fault (or from the start, for bad input) to the end of mpiexec, the first `pipeinfer: error`
line, whether the text generated before the fault was on stdout, what --results got and when the last rank
process of the job was gone. Faults are injected from outside, as a user would: `kill -STOP` / `kill -9` of one
rank's process, found through the job's tag in its environment (helpers.rank_pids), or `ip link set pi-hI down`,
which cuts host hI of the emulated cluster (launch/cluster/netns-cluster.sh, root only) off the network.
tests/test_failures.py checks each row's expectation; launch/bench/failures.py measures the table by running this file as
a program (`python tests/faults.py --list`, `--models DIR`, `--measure NAME --mpi M --models DIR --work DIR`: JSON
on stdout), so that launch/ never imports the tests.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers import (MPIEXEC, NETNS, NETNS_MPI_ARGS, ROOT, make_big_model, mpi_env, mpi_run, new_tag, rank_pids,
                     tagged_env)

MPIS = ("mpich", "openmpi")
STALL = 3.0  # --stall-timeout of the fault cases (seconds)
# the network cut's --stall-timeout: what a user would set on a real network, where a few seconds without
# a packet must not end the job
NET_STALL = 10.0
CUT = "link-down"  # a fault that takes a host's link down instead of sending a signal


@dataclass
class Case:
    name: str                 # short id (tests refer to it)
    what: str                 # the row's first column
    n: int                    # ranks
    args: list[str]           # after `pipeinfer`; {model}, {q8}, {draft_other}, {tmp}, {arch}, ... are filled in
    match: str                # expected in the first error line
    exit_code: int | tuple    # expected exit code(s) of mpiexec
    fault: tuple | None = None  # (signal, rank) sent once the text has started, or (CUT, rank): its host cut off
    test: str = "tests/test_failures.py"  # where the row is tested
    prep: str | None = None   # a bad input file to make (see _prepare)
    results_status: str | None = None  # expected start of the --results row's status (faults)
    extra: dict = field(default_factory=dict)
    resumes: bool = False     # a supervised run (`generate --np/--hostfile`, no mpiexec): it re-forms and goes on


GEN = ["generate", "-p", "hi", "--ignore-eos", "-t", "1"]


def _long(stall: float) -> list[str]:
    return GEN + ["-m", "{big}", "-n", "3000", "-c", "4096", "--mode", "pipeinfer", "--drafter", "ngram",
                  "--stall-timeout", f"{stall:g}", "--results", "{tmp}/results.csv"]


LONG = _long(STALL)
N_RESUMED = 600  # tokens of a supervised run that survives its fault (the whole answer, resumed)


def _resumed(stall: float, *where: str, draft: tuple = ("--drafter", "ngram")) -> list[str]:
    return LONG[:LONG.index("-n")] + ["-m", "{big}", "-n", str(N_RESUMED), "-c", "4096", "--mode", "pipeinfer",
                                      *draft, "--stall-timeout", f"{stall:g}",
                                      "--results", "{tmp}/results.csv", *where]

CASES: list[Case] = [
    # ---- faults (3 ranks, PipeInfer, a 3,000-token generation; the fault comes once text is streaming)
    Case("stop-worker", "rank 1 of 3 stopped (`kill -STOP`)", 3, LONG, "rank 1 (host", 3,
         fault=(signal.SIGSTOP, 1), results_status="failed: rank 1 (host"),
    Case("stop-last", "last rank (2 of 3) stopped", 3, LONG, "rank 2 (host", 3,
         fault=(signal.SIGSTOP, 2), results_status="failed: rank 2 (host"),
    Case("stop-head", "rank 0 (the head) stopped", 3, LONG, "rank 0 (host", 3, fault=(signal.SIGSTOP, 0)),
    Case("kill-worker", "rank 1 of 3 killed (`kill -9`)", 3, LONG, "rank 1 (host", (9, 3),
         fault=(signal.SIGKILL, 1), results_status="failed: rank 1 (host"),
    Case("kill-head", "rank 0 killed (`kill -9`)", 3, LONG, "", (9, 3), fault=(signal.SIGKILL, 0)),
    Case("netcut-worker", "network cut to a worker host (h2 of 3 emulated hosts, `ip link set pi-h2 down`)", 3,
         _long(NET_STALL), "rank 2 (host h2", 3, fault=(CUT, 2), results_status="failed: rank 2 (host h2",
         test="tests/test_netns.py::test_network_cut_to_a_worker_host", extra={"netns": True}),
    # ---- the same faults under the supervisor (`generate --np 3`, no mpiexec): the job re-forms on the slots
    # left and the generation goes on where it was; exit 0, the whole text, the row says it resumed
    Case("kill-worker-resumed", "rank 1 of 3 killed, supervised (`generate --np 3`)", 3, _resumed(STALL, "--np", "3"),
         "", 0, fault=(signal.SIGKILL, 1), results_status="ok: resumed 1", resumes=True),
    Case("stop-worker-resumed", "rank 1 of 3 stopped, supervised", 3, _resumed(STALL, "--np", "3"), "", 0,
         fault=(signal.SIGSTOP, 1), results_status="ok: resumed 1", resumes=True),
    Case("kill-head-resumed", "rank 0 of 3 killed, supervised", 3, _resumed(STALL, "--np", "3"), "", 0,
         fault=(signal.SIGKILL, 0), results_status="ok: resumed 1", resumes=True),
    Case("netcut-worker-resumed", "network cut to h2 of 3 emulated hosts, supervised (`--hostfile`)", 3,
         _resumed(NET_STALL, "--hostfile", "{tmp}/hosts-netns"), "", 0, fault=(CUT, 2), prep="hosts-netns",
         results_status="ok: resumed 1", resumes=True, extra={"netns": True},
         test="tests/test_netns.py::test_supervised_generate_survives_a_cut_link"),
    Case("kill-draft-host-resumed", "the draft host's rank killed, supervised (`--hostfile` with a `role=draft` host)",
         3, _resumed(STALL, "--hostfile", "{tmp}/hosts-draft", draft=("--draft", "{q8}")), "", 0,
         fault=(signal.SIGKILL, 2), prep="hosts-draft", results_status="ok: resumed 1", resumes=True),
    Case("no-slot-left", "the only rank killed, supervised (`generate --np 1`): nothing to re-form on", 1,
         _resumed(STALL, "--np", "1"), "no slot left to run the pipeline on", 1, fault=(signal.SIGKILL, 0),
         results_status="failed: no slot left", resumes=True),
    # ---- bad input (2 ranks unless said)
    Case("gguf-cut-header", "GGUF truncated in its header", 2, GEN + ["-m", "{tmp}/cut-header.gguf"],
         "truncated GGUF header: the file ends in its fixed header", 1, prep="cut-header"),
    Case("gguf-cut-metadata", "GGUF truncated in its metadata", 2, GEN + ["-m", "{tmp}/cut-meta.gguf"],
         "truncated GGUF header: the file ends in its metadata (key", 1, prep="cut-meta"),
    Case("gguf-cut-data", "GGUF truncated in its tensor data", 2, GEN + ["-m", "{tmp}/cut-data.gguf"],
         "truncated GGUF: tensor", 1, prep="cut-data", test="tests/test_cli.py::test_truncated_gguf"),
    Case("gguf-magic", "wrong magic (not a GGUF)", 2, GEN + ["-m", "{tmp}/magic.gguf"], "GGUF magic missing", 1,
         prep="magic"),
    Case("arch", "unsupported architecture (split over ranks)", 2, GEN + ["-m", "{tmp}/mamba.gguf"],
         "architecture 'mamba' is not verified for layer splitting", 1, prep="arch"),
    Case("draft-vocab", "draft with an incompatible vocabulary (`--draft-vocab same`)", 2,
         GEN + ["-m", "{q8}", "--mode", "speculative", "--draft", "{tmp}/v600.gguf", "--draft-vocab", "same"],
         "first mismatch at token id", 1, prep="v600", test="tests/test_cli.py::test_draft_vocabulary_mismatch"),
    Case("split-negative", "`--layer-split` with a negative part", 2, GEN + ["-m", "{q8}", "--layer-split", "1.5,-0.5"],
         "must be finite and >= 0", 1),
    Case("split-zero", "`--layer-split` with a zero part", 2, GEN + ["-m", "{q8}", "--layer-split", "1,0"],
         "every rank needs at least one layer", 1),
    Case("split-count", "`--layer-split` with more parts than ranks", 2,
         GEN + ["-m", "{q8}", "--layer-split", "0.5,0.3,0.2"], "3 fractions but there are 2 target ranks", 1,
         test="tests/test_cli.py::test_split_count_mismatch"),
    Case("ranks-layers", "more ranks than layers (5 ranks, 4 layers)", 5, GEN + ["-m", "{q8}"], "only 4 layers", 1,
         test="tests/test_cli.py::test_more_ranks_than_layers"),
    Case("threads-long", "`-t` list longer than the ranks", 2, ["generate", "-p", "hi", "-m", "{q8}", "-t", "1,1,1"],
         "--threads needs one positive value or 2 (one per rank)", 1),
    Case("threads-short", "`-t` list shorter than the ranks", 3, ["generate", "-p", "hi", "-m", "{q8}", "-t", "1,1"],
         "--threads needs one positive value or 3 (one per rank)", 1),
    Case("prompt-ctx", "prompt longer than the context", 2, GEN + ["-m", "{q8}", "-p", "ba " * 400, "-c", "64"],
         "does not fit the context", 1, test="tests/test_cli.py::test_prompt_longer_than_context"),
    Case("hostfile-line", "hostfile with a bad line", 0, ["launch", "--hostfile", "{tmp}/hosts-bad", "--dry-run", "--",
                                                           "generate", "-p", "hi"], ":2: bad host entry", 1,
         prep="hosts-bad"),
    Case("hostfile-role", "hostfile with an unknown role (`role=drafter`)", 0,
         ["launch", "--hostfile", "{tmp}/hosts-role", "--dry-run", "--", "generate", "-p", "hi"],
         ":2: unknown role 'drafter'", 1, prep="hosts-role"),
    Case("draft-rank-no-model", "a draft rank without a draft model (`--draft-at rank`, n-gram drafter)", 3,
         GEN + ["-m", "{q8}", "--drafter", "ngram", "--draft-at", "rank"], "the draft rank has no draft model", 1),
    # since weights travel (ranks/weights.py) such a rank is no failure: it gets rank 0's bytes, never its own file
    Case("model-differs", "a rank with another model file at the same path (it receives rank 0's stage file)", 2,
         GEN + ["-m", "{tmp}/per-rank.gguf"], "", 0, prep="per-rank", extra={"env_per_rank": True},
         test="tests/test_weights_mpi.py::test_another_file_under_the_same_path_is_never_used"),
    Case("build-differs", "a rank running another build (an edited copy of pipeinfer)", 2, GEN + ["-m", "{q8}"],
         "rank 1 (host", 1, prep="build", extra={"build_per_rank": True}),
    Case("bad-header", "a header announcing a 4 EiB payload (tests/mpi_badmsg.py)", 2, [],
         "rank 1 refused a message from rank 0 (host", 1,
         extra={"cmd": ["{python}", "-m", "mpi4py", "{root}/tests/mpi_badmsg.py", "huge", "--as-cli"]}),
]


def _prepare(kind: str, tmp: Path, models: dict) -> None:
    """The bad input files (synthetic models from tests/synth.py)."""
    from synth import make_llama_gguf
    data = models["q8"].read_bytes()
    if kind == "cut-header":
        (tmp / "cut-header.gguf").write_bytes(data[:16])
    elif kind == "cut-meta":
        (tmp / "cut-meta.gguf").write_bytes(data[:_metadata_midpoint(models["q8"])])
    elif kind == "cut-data":
        (tmp / "cut-data.gguf").write_bytes(data[:len(data) // 2])
    elif kind == "magic":
        (tmp / "magic.gguf").write_bytes(b"GGUX" + data[4:])
    elif kind == "arch":
        _write_arch(tmp / "mamba.gguf", "mamba")
    elif kind == "v600":
        make_llama_gguf(tmp / "v600.gguf", n_layer=2, n_vocab=600)
    elif kind == "hosts-netns":
        (tmp / "hosts-netns").write_text("h0\nh1\nh2\n")
    elif kind == "hosts-draft":  # two names of this machine: 2 target ranks, then the draft's rank
        (tmp / "hosts-draft").write_text("localhost:2\n127.0.0.1 # pipeinfer: role=draft\n")
    elif kind == "hosts-bad":
        (tmp / "hosts-bad").write_text("node1:2\nnode2:two\n")
    elif kind == "hosts-role":
        (tmp / "hosts-role").write_text("node1:1 # pipeinfer: threads=2\nnode2:1 # pipeinfer: role=drafter\n")
    elif kind == "build":
        # rank 1's host has another build: the package copied and one source file edited
        dst = tmp / "build1" / "pipeinfer"
        shutil.copytree(ROOT / "pipeinfer", dst, ignore=shutil.ignore_patterns("__pycache__"))
        with open(dst / "__init__.py", "a") as f:
            f.write("# a local edit on this host\n")
    elif kind == "per-rank":
        # the same path names a different file on rank 1's "host": PIPEINFER_MODEL_ROOT differs per rank
        for r, m in ((0, models["q8"]), (1, models["q8b"])):
            d = tmp / f"host{r}"
            d.mkdir(exist_ok=True)
            shutil.copy(m, d / "per-rank.gguf")


def _metadata_midpoint(path: Path) -> int:
    """A byte offset inside the key-value metadata (after the 24-byte fixed header, before the tensor infos)."""
    from pipeinfer.engine.ggufheader import read_header
    h = read_header(path)
    start = min(t.offset for t in h.tensors.values())
    return 24 + (start - 24) // 4  # metadata comes first and is most of a synthetic header


def _write_arch(path: Path, arch: str) -> None:
    import gguf
    import numpy as np
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(4)
    w.add_embedding_length(64)
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


RANK = "${PMI_RANK:-$OMPI_COMM_WORLD_RANK}"  # a rank's number in a shell, under MPICH or Open MPI


def _command(case: Case, args: list[str], tmp: Path, mpi: str = "mpich") -> list[str]:
    base = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer"]
    if case.extra.get("cmd"):
        return mpi_run(mpi, case.n) + [a.format(python=sys.executable, root=ROOT) for a in case.extra["cmd"]]
    if case.resumes:  # the supervisor starts the job itself (on the emulated hosts: up, run, down, always)
        if not case.extra.get("netns"):
            return [sys.executable, "-m", "pipeinfer"] + args
        return ["bash", "-c", f'bash {NETNS} up {case.n} >&2 || exit 1; trap "bash {NETNS} down {case.n} >&2" EXIT; '
                '"$@"', "netns", sys.executable, "-m", "pipeinfer"] + args
    if case.extra.get("netns"):
        # one rank per emulated host: rank I runs in namespace hI
        return ["bash", str(NETNS), "run", str(case.n), "--"] + base + args
    if case.extra.get("build_per_rank"):
        pp = f'{tmp}/build1:{os.environ.get("PYTHONPATH", "")}'
        return mpi_run(mpi, case.n) + ["bash", "-c", f'if [ "{RANK}" = 1 ]; then export PYTHONPATH={pp}; fi; '
                                       f'exec "$@"', "rank"] + base + args
    if case.extra.get("env_per_rank"):
        # one model path, two files: each rank reads it from its own "host" directory (what another
        # host's copy would be): a wrapper runs the rank in host{RANK}/
        args = [a.replace(str(tmp / "per-rank.gguf"), "per-rank.gguf") for a in args]
        return mpi_run(mpi, case.n) + ["bash", "-c", f'cd {tmp}/host{RANK} && exec "$@"', "rank"] + base + args
    if case.n:
        return mpi_run(mpi, case.n) + base + args
    return base + args


def _inject(fault: tuple, tag: str) -> bool:
    """Inject the fault into the running job; False when its target was not found."""
    kind, rank = fault
    if kind == CUT:
        # the root side of host hI's veth pair: the host and its processes run on, nothing crosses its link
        return subprocess.run(["ip", "link", "set", f"pi-h{rank}", "down"]).returncode == 0
    pids = rank_pids(tag)
    if rank not in pids:
        return False
    os.kill(pids[rank], kind)
    return True


def _stall(case: Case) -> float:
    return float(case.args[case.args.index("--stall-timeout") + 1]) if "--stall-timeout" in case.args else STALL


def _ranks_gone(tag: str, deadline: float) -> float | None:
    """Wait until no rank process of the job is left (a host cut off from mpiexec ends its ranks itself);
    the time then, or None at the deadline, when the ones left are killed (they are this script's)."""
    while time.monotonic() < deadline:
        if not rank_pids(tag):
            return time.monotonic()
        time.sleep(0.1)
    for pid in rank_pids(tag).values():
        os.kill(pid, signal.SIGKILL)
    return None


def _netns_down(stderr: str) -> None:
    """Remove the emulated hosts if this run made them and could not remove them itself (it was killed)."""
    if "netns-cluster: up:" in stderr and "netns-cluster: down:" not in stderr:
        subprocess.run(["bash", str(NETNS), "down"], capture_output=True)


def run_case(case: Case, models: dict, tmp: Path, timeout: float = 120, mpi: str = "mpich") -> dict:
    """Run one case under `mpi` (MPIS); a dict of what the user saw."""
    fill = {"q8": models["q8"], "big": models["big"], "tmp": tmp}
    if case.prep:
        _prepare(case.prep, tmp, models)
    cmd = _command(case, [a.format(**fill) for a in case.args], tmp, mpi)
    tag = new_tag()
    env = tagged_env(tag, mpi_env(mpi, MPIEXEC=MPIEXEC))  # netns-cluster.sh runs this mpiexec
    if case.resumes and case.extra.get("netns"):  # how the supervisor's launcher reaches the emulated hosts
        env["PIPEINFER_MPI_ARGS"] = NETNS_MPI_ARGS
    if os.path.exists(tmp / "results.csv"):
        os.unlink(tmp / "results.csv")
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=tmp)
    out, err, seen = bytearray(), bytearray(), {}

    def pump(src, dst, mark=None):
        for chunk in iter(lambda: src.read1(4096), b""):
            dst += chunk
            if mark and mark not in seen and mark in dst:
                seen[mark] = time.monotonic()
    # netns-cluster.sh's line marks the end of the user's job, before the emulated hosts are removed
    end_mark = b"netns-cluster: mpiexec exited"
    threads = [threading.Thread(target=pump, args=(p.stdout, out), daemon=True),
               threading.Thread(target=pump, args=(p.stderr, err, end_mark), daemon=True)]
    for t in threads:
        t.start()
    t_fault, text_before, t_ranks = None, 0, None
    try:
        if case.fault:
            while len(out) < 200 and p.poll() is None and time.monotonic() - t0 < timeout:  # the text is streaming
                time.sleep(0.05)
            text_before = len(out)
            if p.poll() is None and _inject(case.fault, tag):  # (a job that ended has no host left to cut)
                t_fault = time.monotonic()
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in rank_pids(tag).values():
                os.kill(pid, signal.SIGKILL)
            p.terminate()  # netns-cluster.sh then removes its hosts
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        t_end = seen.get(end_mark, time.monotonic())
        if t_fault:
            t_ranks = _ranks_gone(tag, t_fault + _stall(case) + 10)
        for t in threads:
            t.join(timeout=5)
    finally:
        _netns_down(err.decode(errors="replace"))
    stderr = err.decode(errors="replace").replace(f"{tmp}/", "")  # file names as the user gave them
    errors = [l for l in stderr.splitlines() if l.startswith("pipeinfer: error")]
    status, n_generated = None, None
    if case.results_status is not None or case.fault:
        from pipeinfer.core.results import read_results
        rows = read_results(tmp / "results.csv")
        status, n_generated = (rows[-1]["status"], rows[-1]["n_generated"]) if rows else (None, None)
    reform = [ln for ln in stderr.splitlines() if "re-formed in" in ln]
    return {
        "case": case.name, "mpi": mpi, "what": case.what, "exit_code": p.returncode,
        "seconds": round(t_end - (t_fault or t0), 1), "from": "fault" if t_fault else "start",
        "ranks_gone_s": round(t_ranks - t_fault, 1) if t_ranks else None,
        "error": errors[0] if errors else "", "n_error_lines": len(errors), "traceback": "Traceback" in stderr,
        "stdout_bytes_at_fault": text_before if t_fault else None, "stdout_bytes": len(out),
        "results_status": status, "n_generated": n_generated, "reform": reform[0] if reform else "",
        "stderr_tail": stderr[-1500:],
    }


def make_models(d: Path) -> dict:
    from synth import make_llama_gguf
    d.mkdir(parents=True, exist_ok=True)
    return {
        "q8": make_llama_gguf(d / "t-q8.gguf", n_layer=4, qtype="q8_0"),
        "q8b": make_llama_gguf(d / "t-q8b.gguf", n_layer=4, qtype="q8_0", seed=5),
        "big": make_big_model(d),
    }


def check_resumed(case: Case, r: dict) -> None:
    """A supervised run's row: the job re-formed and the whole answer came, or (no slot left) one line, exit 1."""
    ctx = f"{r['error']}\n{r['stderr_tail']}"
    if case.exit_code != 0:
        assert r["n_error_lines"] == 1 and case.match in r["error"], ctx
        assert r["seconds"] < STALL + 10, ctx
        assert (r["results_status"] or "").startswith(case.results_status) and r["n_generated"] > 0, ctx
        return
    assert r["n_error_lines"] == 0 and "re-formed in" in r["reform"], ctx
    assert r["stdout_bytes"] > r["stdout_bytes_at_fault"] > 0, ctx
    assert r["results_status"] == case.results_status and r["n_generated"] == N_RESUMED, ctx


def main(argv: list[str]) -> None:
    """The cases for launch/bench/failures.py, as JSON on stdout: --list (name, test, netns of each, and the MPIs),
    --models DIR (the synthetic models made there), --measure NAME --mpi M --models DIR --work DIR (one row)."""
    import argparse
    import json
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--measure", metavar="NAME")
    ap.add_argument("--mpi", choices=MPIS, default="mpich")
    ap.add_argument("--models", type=Path)
    ap.add_argument("--work", type=Path)
    a = ap.parse_args(argv)
    if a.list:
        print(json.dumps({"mpis": list(MPIS), "cases": [{"name": c.name, "test": c.test, "netns": bool(c.extra.get("netns"))}
                                                       for c in CASES]}))
    elif a.measure:
        case = next(c for c in CASES if c.name == a.measure)
        print(json.dumps(run_case(case, make_models(a.models), a.work, mpi=a.mpi), default=str))
    else:
        make_models(a.models)


if __name__ == "__main__":
    main(sys.argv[1:])
