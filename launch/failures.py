#!/usr/bin/env python
"""What the user sees for each fault and bad input: the README's "Failure behaviour" table, measured.

    python launch/failures.py [--out results/failures] [--only NAME ...] [--mpi mpich openmpi]

Each case runs the real CLI under mpiexec on small synthetic GGUFs (tests/synth.py) and records the exit
code, the seconds from the fault (or from the start, for bad input) to the end of mpiexec, the first
`pipeinfer: error` line, whether the text generated before the fault was on stdout, what --results
got and when the last rank process of the job was gone. Faults are injected from outside, as a user
would: `kill -STOP` / `kill -9` of one rank's process, found through a tag in its environment, or
`ip link set pi-hI down`, which cuts host hI of the emulated cluster (launch/netns-cluster.sh, root
only; skipped with a note elsewhere) off the network. Writes OUT.csv and OUT.md (a markdown table) and
prints the table; with --only, the named rows are measured again and the others kept from OUT.csv.
tests/test_failures.py runs the same cases (CASES) and checks each row's expectation.

--mpi picks the MPIs each case runs under (the table's MPI column): `mpich`, the mpich wheel's mpiexec (the
default), and `openmpi`, Open MPI's mpirun with mpi4py loading Open MPI's library (MPI4PY_MPIABI=openmpi, as the
README's cluster section sets it up; needs openmpi-bin). The emulated cluster's row runs under MPICH only.
"""
from __future__ import annotations

import argparse
import csv
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec") or "mpiexec"
MPIS = ("mpich", "openmpi")
# what makes a job run on Open MPI: mpi4py's MPI ABI switch, and mpirun's consent to run as root (CI is root)
OPENMPI_ENV = {"MPI4PY_MPIABI": "openmpi", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
NETNS = ROOT / "launch" / "netns-cluster.sh"
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
    Case("model-differs", "a rank with another model file at the same path", 2,
         GEN + ["-m", "{tmp}/per-rank.gguf"], "rank 1 (host", 1, prep="per-rank",
         extra={"env_per_rank": True}),
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


def make_models(d: Path) -> dict:
    from synth import make_llama_gguf
    d.mkdir(parents=True, exist_ok=True)
    return {
        "q8": make_llama_gguf(d / "t-q8.gguf", n_layer=4, qtype="q8_0"),
        "q8b": make_llama_gguf(d / "t-q8b.gguf", n_layer=4, qtype="q8_0", seed=5),
        # big enough that 3,000 tokens take a while on 3 ranks (about 100 tokens/s here)
        "big": make_llama_gguf(d / "big.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=4, n_ff=1024,
                               n_ctx_train=8192),
    }


def _rank_pids(tag: str) -> dict[int, int]:
    """pid of each rank of the job whose environment carries PIPEINFER_FAULT_TAG=tag."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            env = dict(kv.split("=", 1) for kv in (p / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
            cmd = (p / "cmdline").read_bytes()
        except OSError:
            continue
        rank = env.get("PMI_RANK", env.get("OMPI_COMM_WORLD_RANK"))  # MPICH's, Open MPI's
        if env.get("PIPEINFER_FAULT_TAG") == tag and rank is not None and b"pipeinfer" in cmd:
            out[int(rank)] = int(p.name)
    return out


def netns_unavailable() -> str | None:
    """Why the emulated cluster (launch/netns-cluster.sh) cannot run here, or None."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if not shutil.which("ip") or not shutil.which("tc"):
        return "needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", "pipeinfer-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", "pipeinfer-probe"], capture_output=True)
    return None


@functools.lru_cache(maxsize=1)
def openmpi_launcher() -> str:
    """Open MPI's mpirun, found as `pipeinfer launch` finds it (RuntimeError saying why there is none)."""
    from pipeinfer.wire.launcher import choose_launcher, mpi4py_library
    lib = mpi4py_library(sys.executable, dict(os.environ, **OPENMPI_ENV))
    if lib.kind != "openmpi":
        raise RuntimeError(f"with MPI4PY_MPIABI=openmpi mpi4py loads {lib.name}, not Open MPI")
    return choose_launcher(lib)


def mpi_run(mpi: str, n: int) -> list[str]:
    """The start of a command line that runs n local ranks under `mpi` (with mpi_env's environment)."""
    if mpi == "openmpi":  # more ranks than the 2 cores here: --oversubscribe
        return [openmpi_launcher(), "--oversubscribe", "--bind-to", "none", "-n", str(n)]
    return [MPIEXEC, "-n", str(n)]


def mpi_env(mpi: str, **more) -> dict:
    return dict(os.environ, **(OPENMPI_ENV if mpi == "openmpi" else {}), **more)


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
    pids = _rank_pids(tag)
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
        if not _rank_pids(tag):
            return time.monotonic()
        time.sleep(0.1)
    for pid in _rank_pids(tag).values():
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
    tag = uuid.uuid4().hex
    env = mpi_env(mpi, PIPEINFER_FAULT_TAG=tag, MPIEXEC=MPIEXEC)  # netns-cluster.sh runs this mpiexec
    if case.resumes and case.extra.get("netns"):  # how the supervisor's launcher reaches the emulated hosts
        env["PIPEINFER_MPI_ARGS"] = (f"-iface brpi -launcher ssh -launcher-exec {ROOT}/launch/netns-exec "
                                     "-genv UCX_TLS tcp -genv FI_PROVIDER tcp")
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
            for pid in _rank_pids(tag).values():
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


def _measure(case: Case, models: dict, work: Path, mpi: str) -> dict | None:
    why = netns_unavailable() if case.extra.get("netns") else None
    if case.extra.get("netns") and mpi != "mpich":
        why = "the emulated cluster runs MPICH's mpiexec only"
    if why:
        print(f"{case.name} ({mpi}): skipped ({why}); its row is kept from the last run", file=sys.stderr, flush=True)
        return None
    tmp = work / f"{case.name}-{mpi}"
    tmp.mkdir()
    r = run_case(case, models, tmp, mpi=mpi)
    r["test"] = case.test
    print(f"{case.name} ({mpi}): exit {r['exit_code']} in {r['seconds']} s: {r['error'][:150]}", file=sys.stderr,
          flush=True)
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "results" / "failures"))
    ap.add_argument("--only", nargs="*", default=None, metavar="NAME", help="measure these cases only (CASES' names)")
    ap.add_argument("--mpi", nargs="+", choices=MPIS, default=["mpich"], help="the MPIs to measure under")
    a = ap.parse_args()
    unknown = set(a.only or []) - {c.name for c in CASES}
    if unknown:
        ap.error(f"no case named {', '.join(sorted(unknown))} (known: {', '.join(c.name for c in CASES)})")
    work = Path(tempfile.mkdtemp(prefix="pipeinfer-failures-"))
    os.environ.setdefault("PIPEINFER_STAGE_CACHE", str(work / "stages"))
    try:
        models = make_models(work / "models")
        measured = {(c.name, mpi): _measure(c, models, work, mpi) for c in CASES for mpi in a.mpi
                    if not a.only or c.name in a.only}
        old = _old_rows(a.out)
        keys = [(c.name, mpi) for c in CASES for mpi in MPIS]  # each case's MPICH row, then its Open MPI row
        rows = [measured.get(k) or old[k] for k in keys if measured.get(k) or k in old]
        with open(a.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, COLS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
        table = _table(rows)
        Path(a.out + ".md").write_text(table + "\n")
        print(table)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
