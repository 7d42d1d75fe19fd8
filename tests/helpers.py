"""What several test modules share: running the CLI and ranks, a job's processes by their tag (launch/harness.py,
which the benchmark scripts use too), waiting for a state with a deadline, a served HTTP endpoint and its streams,
long generations to stop, and Open MPI and the emulated cluster found or refused. Fixtures live in conftest.py; no
test module imports another."""
from __future__ import annotations

import functools
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

sys.path.insert(1, str(Path(__file__).resolve().parent.parent / "launch"))  # harness.py (shared with launch/)
from harness import (JOB_TAG, free_port, headless_chromium, kill_tagged, netns_unavailable, new_tag,  # noqa: E402,F401
                     rank_pids, tagged_env, tagged_pids)
from synth import PROMPT_TOKENS, make_llama_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec") or "mpiexec"
PROMPT = PROMPT_TOKENS
PY = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer"]


def mpirun(n: int, cfg: dict, timeout: float = 180) -> dict:
    """Run tests/mpi_gen.py on n ranks; returns rank 0's JSON result."""
    cmd = [MPIEXEC, "-n", str(n), sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_gen.py"), json.dumps(cfg)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    line = next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def cli(args: list[str], n: int | None = None, timeout: float = 120, env=None) -> subprocess.CompletedProcess:
    """Run the pipeinfer CLI, under mpiexec -n n when n is given."""
    cmd = ([MPIEXEC, "-n", str(n)] + PY if n else PY) + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def real_model(name: str) -> str:
    """Path of an installed registry model; skip (or fail under PIPEINFER_REQUIRE_REAL) when missing."""
    import pytest

    from pipeinfer.engine.models import ModelError, resolve_model
    try:
        return str(resolve_model(name))
    except ModelError as e:
        if os.environ.get("PIPEINFER_REQUIRE_REAL"):
            raise
        pytest.skip(str(e))


def make_big_model(d: Path) -> Path:
    """A synthetic model big enough that 3,000 tokens take a while on 3 ranks (about 100 tokens/s here)."""
    d.mkdir(parents=True, exist_ok=True)
    return make_llama_gguf(d / "big.gguf", n_layer=6, n_embd=256, n_head=4, n_head_kv=4, n_ff=1024, n_ctx_train=8192)


# ---------------------------------------------------------------- waiting for a state, with a deadline
def wait_until(check: Callable, timeout: float, what: str | Callable[[], str], every: float = 0.1):
    """check()'s first true value, polled every `every` s; AssertionError naming `what` (a string, or a function
    giving one, such as a log's tail) when it is still false after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g} s: {what() if callable(what) else what}")
        time.sleep(every)


# ---------------------------------------------------------------- HTTP
def http_request(port: int, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120):
    """(status, headers with lower-case names, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    try:
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


def healthy(port: int) -> bool:
    try:
        return http_request(port, "GET", "/health", timeout=5)[0] == 200
    except OSError:
        return False


def open_stream(port: int, body: dict, path: str = "/v1/completions", timeout: float = 300):
    """A streamed request sent; (connection, response) once its headers are in."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", path, body=json.dumps(dict(body, stream=True)), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def sse_events(resp):
    """A stream's event objects, up to `data: [DONE]` (or an error object, which ends a stream without it); the
    connection is not read past them (it stays open for the next request)."""
    while True:
        line = resp.readline()  # (readline undoes the chunked transfer encoding)
        assert line, "the stream ended without data: [DONE]"
        if line.startswith(b"data: [DONE]"):
            return
        if line.startswith(b"data: "):
            event = json.loads(line[6:])
            yield event
            if "error" in event:
                return


def hang_up(conn) -> None:
    """Leave mid-stream, as a client that goes away."""
    conn.sock.shutdown(socket.SHUT_RDWR)
    conn.close()


class Server:
    """`pipeinfer serve ARGS` on a free loopback port, under `mpiexec -n RANKS` (RANKS None: no mpiexec, a
    supervised server, whose ARGS say --np or --hostfile); stderr and stdout kept in a file; its processes tagged."""

    def __init__(self, args: list[str], ranks: int | None, log_path, timeout: float = 120, env: dict | None = None,
                 command: list[str] | None = None):
        """`command`: what runs `serve` instead of `python -m pipeinfer serve` (e.g. a Slurm allocation's launch)."""
        self.port, self.log_path, self.tag = free_port(), log_path, new_tag()
        self.supervised = ranks is None
        launch = [MPIEXEC, "-n", str(ranks), sys.executable, "-m", "mpi4py"] if ranks else [sys.executable]
        cmd = (command or launch + ["-m", "pipeinfer", "serve"]) + ["--port", str(self.port)] + args
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=tagged_env(self.tag, env))
        deadline = time.monotonic() + timeout
        while not healthy(self.port):
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"server did not come up in {timeout} s:\n{self.text()[-3000:]}")
            time.sleep(0.2)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def request(self, method: str, path: str, body=None, raw: bytes | None = None, timeout: float = 120):
        return http_request(self.port, method, path, body, raw, timeout)

    def health(self) -> dict:
        return json.loads(self.request("GET", "/health")[2])

    def stream(self, body: dict, on_piece=None, path: str = "/v1/completions") -> str:
        """A streamed completion's text, read up to [DONE]; on_piece(k) is called after the k-th piece."""
        conn, r = open_stream(self.port, body, path)
        try:
            assert r.status == 200, r.read()
            text, k = "", 0
            for event in sse_events(r):
                if "choices" not in event:  # an error object ends the stream
                    break
                text += event["choices"][0]["text"]
                k += 1
                if on_piece:
                    on_piece(k)
            return text
        finally:
            conn.close()

    def job_ranks(self) -> dict[int, int]:
        """rank -> pid of the ranks serving now (a supervised server's current job)."""
        return rank_pids(self.tag, attached=self.supervised)

    def text(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return open(self.log_path).read()

    def wait_for_log(self, pattern: str, timeout: float = 30) -> re.Match:
        """The first match of the regex in the log, once it is there (mpiexec forwards a rank's lines later)."""
        return wait_until(lambda: re.search(pattern, self.text()), timeout,
                          lambda: f"no {pattern!r} in the log:\n{self.text()[-2000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)  # like Ctrl-C in the terminal mpiexec runs in
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        kill_tagged(self.tag)
        self.log.close()
        return self.proc.returncode


# ---------------------------------------------------------------- supervised jobs (tests/test_supervisor.py, netns)
PROMPT_TEXT = "ba ki lo"  # a prompt of the served synthetic models
JOBS = [(PROMPT_TEXT, 600, 0.0, 0), ("lo ki ba", 500, 2.0, 5), ("ki ki", 550, 0.0, 0)]


def universal_newlines(text: str) -> str:
    """As the reference reaches us: `generate`'s stdout read in text mode turns a "\r" into "\n"."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


def reference(model: Path, n: int, *extra, prompt: str = PROMPT_TEXT) -> str:
    """`generate`'s text on 2 ranks under mpiexec (iterative): what a supervised answer must equal."""
    p = cli(["generate", "-m", str(model), "-p", prompt, "--no-chat", "-n", str(n), "-q", "--mode", "iterative",
             *extra], n=2, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout[:-1]


def job_references(model: Path) -> list[str]:
    return [reference(model, n, "--temp", str(t), "--top-p", "0.95", "--seed", str(sd), prompt=p)
            for p, n, t, sd in JOBS]


def stream_jobs(srv: Server, jobs, on_first_piece) -> dict[int, str]:
    """Every job (prompt, max_tokens, temperature, seed) streamed at once; on_first_piece(k) sees the first job's
    k-th piece (to cause a failure mid-answer). Returns each job's text."""
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        p, n, t, sd = jobs[i]
        got[i] = srv.stream({"model": "t-q8", "prompt": p, "max_tokens": n, "temperature": t, "top_p": 0.95,
                             "seed": sd}, on_first_piece if i == 0 else None)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got



def stream_through_a_cut(srv: Server, refs: list[str]) -> None:
    """JOBS streamed at once while h2's link (the emulated cluster's) goes down at the first job's 20th piece: every
    answer equals its no-failure reference, and the server is degraded, rank 2 (host h2) lost."""
    cut = threading.Event()

    def on_piece(k: int) -> None:
        if k == 20 and not cut.is_set():
            cut.set()
            subprocess.run(["ip", "link", "set", "pi-h2", "down"], check=True)
    got = stream_jobs(srv, JOBS, on_piece)
    assert cut.is_set()
    for i, ref in enumerate(refs):
        assert universal_newlines(got[i]) == ref, (i, srv.text()[-2000:])
    health = srv.health()
    assert health["status"] == "degraded" and health["lost"] == ["rank 2 (host h2)"], health

# ---------------------------------------------------------------- Open MPI and the emulated cluster
# what makes a job run on Open MPI: mpi4py's MPI ABI switch, and mpirun's consent to run as root (CI is root)
OPENMPI_ENV = {"MPI4PY_MPIABI": "openmpi", "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
NETNS = ROOT / "launch" / "cluster" / "netns-cluster.sh"
# how the supervisor's launcher reaches the emulated hosts
NETNS_MPI_ARGS = (f"-iface brpi -launcher ssh -launcher-exec {ROOT}/launch/cluster/netns-exec "
                  "-genv UCX_TLS tcp -genv FI_PROVIDER tcp")


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


# ---------------------------------------------------------------- a long generation, stopped (test_stop, test_openmpi)
N_LONG = 8000  # tokens: 14 s at the 590 tokens/s 2 ranks reach on the big synthetic model here, a signal comes sooner


def long_generation(model: Path, results: Path) -> list[str]:
    """`pipeinfer generate` arguments for a generation that streams for far longer than a test waits."""
    return ["generate", "-p", "hi", "--ignore-eos", "-t", "1", "-m", str(model), "-n", str(N_LONG), "-c", "8192",
            "--mode", "pipeinfer", "--drafter", "ngram", "--results", str(results)]


class Job:
    """A command started in a session of its own (as from a terminal), its stdout and stderr in files, its
    processes tagged."""

    def __init__(self, cmd: list[str], tmp: Path, env: dict | None = None):
        self.out, self.err = tmp / "out.txt", tmp / "err.txt"
        self.tag = new_tag()
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=tagged_env(self.tag, env), cwd=tmp,
                                         start_new_session=True)

    def wait_for_text(self, n_bytes: int = 200, timeout: float = 120) -> None:
        """Until n_bytes of text are on stdout."""
        def enough() -> bool:
            assert self.proc.poll() is None, f"ended with {self.proc.returncode} before any text:\n{self.stderr()}"
            return self.out.stat().st_size >= n_bytes
        wait_until(enough, timeout, lambda: f"no text:\n{self.stderr()}", every=0.05)

    def signal_rank(self, rank: int, sig: int) -> None:
        os.kill(rank_pids(self.tag)[rank], sig)

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_tagged(self.tag)
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise AssertionError(f"still running {timeout} s after the signal:\n{self.stderr()}") from None

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(errors="replace")


def assert_clean_stop(job: Job, results: Path, why: str) -> None:
    """The text so far on stdout (its line ended), "stopped by WHY", no error line, no traceback, and the --results
    row marked stopped."""
    from pipeinfer.core.results import read_results
    err = job.stderr()
    assert f"[pipeinfer] stopped by {why} after " in err, err[-3000:]
    assert "pipeinfer: error" not in err and "Traceback" not in err, err[-3000:]
    assert job.stdout().endswith("\n") and job.out.stat().st_size >= 200  # (what streamed before the signal, and more)
    rows = read_results(results)
    assert rows[-1]["status"] == f"stopped: {why}" and 0 < int(rows[-1]["n_generated"]) < N_LONG, rows[-1]


class ServeJob(Job):
    """`LAUNCHER... pipeinfer serve` on a free loopback port, the big synthetic model, up and answering."""

    def __init__(self, launcher: list[str], model: Path, tmp: Path, env: dict | None = None, timeout: float = 120):
        self.port = free_port()
        super().__init__(launcher + ["serve", "--port", str(self.port), "-m", str(model), "--drafter", "ngram",
                                     "-t", "1", "-c", "4096", "--alias", "synthetic"], tmp, env)

        def up() -> bool:
            assert self.proc.poll() is None, f"serve ended with {self.proc.returncode}:\n{self.stderr()[-3000:]}"
            return healthy(self.port)
        wait_until(up, timeout, lambda: f"serve not up:\n{self.stderr()[-3000:]}", every=0.2)

    def stream_while(self, stop, max_tokens: int = 300) -> tuple[str, str | None]:
        """A streamed completion; stop() is called once its first piece is in. (text, finish_reason)."""
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="none", max_retries=0, timeout=60)
        pieces, finish = [], None
        for chunk in client.completions.create(model="synthetic", prompt="hi", max_tokens=max_tokens, stream=True):
            if not pieces:
                stop()
            pieces.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(pieces), finish


def assert_served_and_stopped(job: ServeJob) -> None:
    err = job.stderr()
    assert ("[pipeinfer] stopping: finishing the request in progress" in err  # serve under mpiexec / mpirun
            or "[pipeinfer] stopping: the pipeline's job finishes the requests in progress" in err  # supervised
            ), err[-3000:]
    assert "pipeinfer: error" not in err and "Traceback" not in err and "was lost" not in err, err[-3000:]


def host_envs(tmp: Path, n: int) -> list[dict]:
    """Per-rank environments of emulated hosts on one machine: rank 0 sees the real file system; every other rank an
    empty one under a folder of its own (PIPEINFER_HOST_ROOT: no model). Each has caches of its own (weights, stage
    files, exact batch limits)."""
    out = []
    for r in range(n):
        env = {"PIPEINFER_CACHE": str(tmp / f"cache{r}"), "PIPEINFER_STAGE_CACHE": str(tmp / f"stages{r}")}
        if r:
            (tmp / f"root{r}").mkdir(exist_ok=True)
            env["PIPEINFER_HOST_ROOT"] = str(tmp / f"root{r}")
        out.append(env)
    return out


def run_on_hosts(args: list[str], hosts: list[dict], env=None, timeout: float = 120, wait=True):
    """`pipeinfer ARGS` on one rank per entry of `hosts` (host_envs), each with its environment; a Popen when not
    `wait`."""
    cmd = [MPIEXEC]
    for i, h in enumerate(hosts):
        cmd += ([":"] if i else []) + ["-n", "1"]
        for k, v in h.items():
            cmd += ["-env", k, v]
        cmd += [sys.executable, "-m", "mpi4py", "-m", "pipeinfer"] + args
    if not wait:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
