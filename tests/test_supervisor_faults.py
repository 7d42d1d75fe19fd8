"""The supervisor never leaves a request waiting: whatever fails while it re-forms or re-plans the pipeline's job
(here the launcher raising RuntimeError or OSError) fails the requests in flight with an error naming the cause,
/health reports it, and the server exits 1; a --rejoin probe that cannot be launched leaves the job serving.

No MPI: launch.launch_command (pipeinfer/supervisor/launch.py) is replaced by FakeLauncher, whose job is this file run as a script: a fake
rank 0 that speaks the link (serving/link.py) and answers every job with letters, token i of an answer being
letter i, so an answer resumed after a re-form equals the uninterrupted one.
"""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script (the fake rank 0, the wrapped CLI): the package beside the tests
    sys.path.insert(0, str(ROOT))

from pipeinfer.core.errors import UserError  # noqa: E402
from pipeinfer.core.metrics import Stats  # noqa: E402
from pipeinfer.core.sampling import SamplingParams  # noqa: E402
from pipeinfer.serving import link  # noqa: E402
from pipeinfer.serving.job import DoneEvent, ErrorEvent  # noqa: E402

TOKEN_S = 0.01          # the fake rank 0's pace: one token per job this often
WAIT_S = 20.0           # every wait in these tests is bounded by this
FIRST = ord("a")


def letter(position: int) -> int:
    return FIRST + position % 26


# ------------------------------------------------------------------------------------ the fake rank 0
def fake_rank0(sock_path: str, hosts: list[str], fail_after: int | None, n_jobs_first: int, garble: bool) -> None:
    """Attach to the supervisor and answer its jobs; after `fail_after` tokens (all jobs together, once
    `n_jobs_first` jobs came) end as a job whose rank 1 liveness found silent (`garble`: send a line that is no
    message first)."""
    rank0 = link.Link.connect(sock_path)
    rank0.send(link.Ready(len(hosts), 2, [(h, os.getpid()) for h in hosts], [2**30] * len(hosts)))
    jobs: dict[int, list[int]] = {}  # id -> [next position, end position]
    seen: set[int] = set()
    lock, stopping = threading.Lock(), threading.Event()

    def read() -> None:
        for msg in rank0.messages():
            with lock:
                if isinstance(msg, link.Generate):
                    jobs[msg.id] = [len(msg.replay), len(msg.replay) + msg.n_predict]
                    seen.add(msg.id)
                elif isinstance(msg, link.Cancel) and msg.id in jobs:
                    jobs[msg.id][1] = jobs[msg.id][0]
                elif isinstance(msg, link.Stop):
                    break
        stopping.set()
    threading.Thread(target=read, daemon=True).start()
    n_sent = 0
    while not stopping.is_set():
        with lock:
            for jid, (pos, end) in list(jobs.items()):
                if pos >= end:
                    rank0.send(link.Done(jid, Stats(n_generated=end).to_dict()))
                    del jobs[jid]
                else:
                    rank0.send(link.Tokens(jid, [letter(pos)]))
                    jobs[jid][0] += 1
                    n_sent += 1
        if fail_after is not None and n_sent >= fail_after and len(seen) >= n_jobs_first:
            if garble:
                rank0.sock.sendall(b'{"op": "tokens", "id": 0}\n')
                stopping.wait(WAIT_S)
            print(f"pipeinfer: error: rank 1 (host {hosts[1]}) went silent for 3 s (fake)", flush=True)
            os._exit(1)
        time.sleep(TOKEN_S)


class FakeLauncher:
    """Stands in for launch.launch_command. Job launches are counted from 1: `faults` maps a launch's number
    to the exception it raises (once `gate` is set, if given: the test holds a launch to submit meanwhile); the
    first job fails after `fail_after` tokens once `n_jobs_first` jobs came. A --rejoin probe (`pipeinfer --version`) succeeds, or raises
    `probe_fault`."""

    def __init__(self, faults: dict | None = None, fail_after: int | None = None, n_jobs_first: int = 1,
                 garble: bool = False, probe_fault: Exception | None = None, gate: threading.Event | None = None):
        self.faults, self.fail_after, self.n_jobs_first = faults or {}, fail_after, n_jobs_first
        self.garble = garble
        self.probe_fault, self.gate = probe_fault, gate
        self.n_jobs = 0
        self.launching = threading.Event()  # the faulty launch has begun

    def __call__(self, slots: list[str], args: list[str], hostfile: str, environ=None) -> tuple[list[str], dict]:
        if args == ["--version"]:
            if self.probe_fault is not None:
                raise self.probe_fault
            return ["true"], {}
        self.n_jobs += 1
        fault = self.faults.get(self.n_jobs)
        if fault is not None:
            self.launching.set()
            if self.gate is not None:
                assert self.gate.wait(WAIT_S), "the test never released the faulty launch"
            raise fault
        fail_after = self.fail_after if self.n_jobs == 1 else None
        return [sys.executable, __file__, "rank0", args[args.index("attach") + 1], ",".join(slots),
                str(fail_after or 0), str(self.n_jobs_first), "garble" if self.garble else "clean"], {}

    @classmethod
    def from_json(cls, text: str) -> FakeLauncher:
        """The wrapped CLI's launcher: {"faults": {launch: [exception name, message]}, "fail_after": n}."""
        spec = json.loads(text)
        kinds = {"RuntimeError": RuntimeError, "OSError": OSError}
        faults = {int(n): kinds[kind](message) for n, (kind, message) in spec.get("faults", {}).items()}
        return cls(faults, spec.get("fail_after"))


class LetterTokenizer:
    """Token t is the byte t: the fake's letters read as text."""

    def piece(self, token: int) -> bytes:
        return bytes([token % 256])

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


# ------------------------------------------------------------------------------------ driving a Supervisor
class Harness:
    """A Supervisor on two local slots with a FakeLauncher; what it logs, and each on_fatal call."""

    def __init__(self, monkeypatch, launcher: FakeLauncher, slots=("localhost", "localhost"), rejoin=False):
        from pipeinfer.supervisor import launch, supervisor
        monkeypatch.setattr(launch, "launch_command", launcher)
        monkeypatch.setattr(supervisor, "REJOIN_CHECK_S", 0.05)
        self.launcher, self.logs, self.fatal_calls = launcher, [], []
        from pipeinfer.core.config import Config
        self.sup = supervisor.Supervisor(list(slots), Config("fake.gguf"), LetterTokenizer(), log=self.logs.append,
                                         on_fatal=self.fatal_calls.append, rejoin=rejoin)

    def job(self, n_predict: int):
        from pipeinfer.supervisor.resume import StdoutJob
        return StdoutJob([FIRST], n_predict, SamplingParams(), "a", False, as_json=True)

    def submit(self, n_predict: int):
        job = self.job(n_predict)
        self.sup.submit(job)
        return job

    def close(self) -> None:
        self.sup.stop()
        self.sup.lifecycle.kill_child()
        shutil.rmtree(self.sup.work_dir, ignore_errors=True)


@pytest.fixture
def harness(monkeypatch):
    made = []

    def make(launcher: FakeLauncher, **kw) -> Harness:
        made.append(Harness(monkeypatch, launcher, **kw))
        return made[-1]
    yield make
    for h in made:
        h.close()


def outcome(job):
    assert job.finished.wait(WAIT_S), "the request was left waiting"
    return job.outcome


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def assert_failed_with(h: Harness, jobs, cause: str) -> None:
    """Every job failed naming `cause`; the supervisor is fatal with it, said so once, and left no job running."""
    from pipeinfer.serving.job import RequestError
    for job in jobs:
        assert outcome(job) == ErrorEvent(f"the pipeline failed: {cause}"), outcome(job)
    assert h.sup.fatal == cause and h.fatal_calls == [cause]
    assert f"[serve] fatal: {cause}" in h.logs
    assert h.sup.load()["phase"] == "failed"
    assert h.sup.lifecycle.child.process.poll() is not None
    with pytest.raises(RequestError) as later:
        h.sup.submit(h.job(5))
    assert later.value.status == 503 and cause in later.value.message


FAULTS = [RuntimeError("mpi4py loads MPICH but no launcher of it was found (tried: none)"),
          OSError(24, "Too many open files")]


@pytest.mark.parametrize("fault", FAULTS, ids=lambda e: type(e).__name__)
def test_a_launcher_failure_while_reforming_fails_the_requests_in_flight(harness, fault):
    h = harness(FakeLauncher({2: fault}, fail_after=6, n_jobs_first=2))
    h.sup.start()
    jobs = [h.submit(200), h.submit(300)]
    assert_failed_with(h, jobs, f"cannot re-form the pipeline: {type(fault).__name__}: {fault}")
    assert h.sup.lost == ["rank 1 (host localhost)"] and h.launcher.n_jobs == 2
    assert any(line.startswith("[serve] re-forming the pipeline without rank 1") for line in h.logs), h.logs


@pytest.mark.parametrize("fault", FAULTS, ids=lambda e: type(e).__name__)
def test_a_launcher_failure_while_replanning_fails_the_requests_that_wait(harness, fault):
    """--rejoin: rank 1 is lost mid-answer, the job re-forms on one slot and the answer completes as it would have;
    once idle, the lost host (this machine) answers and the job is re-planned on both slots, whose launch raises
    while a request waits for it."""
    gate = threading.Event()
    h = harness(FakeLauncher({3: fault}, fail_after=6, gate=gate), rejoin=True)
    h.sup.start()
    first = h.submit(40)
    assert isinstance(outcome(first), DoneEvent) and first.tokens == [letter(i) for i in range(40)]
    assert h.launcher.launching.wait(WAIT_S), h.logs
    assert h.sup.load()["phase"] == "re-planning"
    waiting = h.submit(30)
    gate.set()
    assert_failed_with(h, [waiting], f"cannot re-plan the pipeline: {type(fault).__name__}: {fault}")
    assert any("answer(s) again: re-planning the pipeline on 2 slot(s) (was 1)" in line for line in h.logs), h.logs


def test_a_probe_that_cannot_be_launched_leaves_the_job_serving(harness):
    """--rejoin on a lost host elsewhere: its probe's launch raises; logged, and the job on the slot left serves
    on (no re-plan, nothing fatal)."""
    h = harness(FakeLauncher(fail_after=6, probe_fault=RuntimeError("no launcher")), slots=("localhost", "far"),
                rejoin=True)
    h.sup.start()
    first = h.submit(40)
    assert isinstance(outcome(first), DoneEvent)
    wait_for(lambda: any("cannot ask far whether it answers: RuntimeError: no launcher" in line
                         for line in h.logs), "the probe's failure in the log")
    later = h.submit(20)
    assert isinstance(outcome(later), DoneEvent) and later.tokens == [letter(i) for i in range(20)]
    load = h.sup.load()
    assert h.sup.fatal is None and not h.fatal_calls and load["phase"] == "serving" and load["ranks"] == 1, load


def test_a_message_rank0_cannot_have_sent_fails_loudly(harness):
    h = harness(FakeLauncher(fail_after=3, garble=True))
    h.sup.start()
    job = h.submit(100)
    assert_failed_with(h, [job], "reading rank 0's messages: LinkError: tokens: field 'tokens' missing")


@pytest.mark.parametrize("fault", FAULTS, ids=lambda e: type(e).__name__)
def test_a_launcher_failure_at_start_is_one_line(harness, fault):
    h = harness(FakeLauncher({1: fault}))
    with pytest.raises(UserError) as e:
        h.sup.start()
    assert str(e.value) == f"cannot start the pipeline's job: {fault}"


# ------------------------------------------------------------------------------------ over HTTP
class HttpFront:
    """The OpenAI app over a Supervisor, served by uvicorn on a thread (a free loopback port)."""

    def __init__(self, sup):
        import uvicorn

        from pipeinfer.frontend.app import ServeConfig, create_app
        app = create_app(ServeConfig("fake", 4096, 0, 16), sup, LetterTokenizer(), lambda messages: "")
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "uvicorn to start")

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=WAIT_S)
        conn.request(method, path, body=json.dumps(body) if body else None,
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(WAIT_S)
        self.sock.close()


def test_the_http_client_and_health_get_the_cause(harness):
    """Over HTTP: a streamed and a whole answer in flight when the re-form's launch raises end with OpenAI's error
    object naming the cause; /health says it (503); a later request is refused (503, pipeline_failed)."""
    h = harness(FakeLauncher({2: RuntimeError("no launcher of MPICH")}, fail_after=6, n_jobs_first=2))
    h.sup.start()
    front = HttpFront(h.sup)
    try:
        cause = "cannot re-form the pipeline: RuntimeError: no launcher of MPICH"
        got: dict = {}
        asks = {"stream": {"model": "fake", "prompt": "a", "max_tokens": 200, "stream": True},
                "whole": {"model": "fake", "prompt": "a", "max_tokens": 300}}
        threads = [threading.Thread(target=lambda k=k: got.update({k: front.request("POST", "/v1/completions",
                                                                                      asks[k])})) for k in asks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        status, body = got["stream"]
        events = [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: {")]
        assert status == 200 and events[-1] == {"error": {"message": f"the pipeline failed: {cause}",
                                                          "type": "server_error", "param": None, "code": None}}
        status, body = got["whole"]
        assert status == 500 and json.loads(body)["error"]["message"] == f"the pipeline failed: {cause}", body
        status, body = front.request("GET", "/health")
        assert status == 503 and json.loads(body) == {"status": "error", "error": cause}
        status, body = front.request("POST", "/v1/completions", asks["whole"])
        assert status == 503 and json.loads(body)["error"]["code"] == "pipeline_failed", body
    finally:
        front.close()


# ------------------------------------------------------------------------------------ the whole server
def test_serve_exits_1_naming_the_cause(models, tmp_path):
    """`pipeinfer serve --np 2` (this file wraps the CLI with a FakeLauncher): the re-form's launch raises, the
    streamed answer ends with the error, and the server exits 1 with one line naming the cause."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    spec = {"faults": {"2": ["RuntimeError", "no launcher of MPICH"]}, "fail_after": 20}
    cmd = [sys.executable, __file__, "serve-with", json.dumps(spec), "serve", "--np", "2", "-m", str(models["q8"]),
           "--mode", "iterative", "-c", "512", "--port", str(port)]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT)
    try:
        wait_for(lambda: _health(port) is not None or proc.poll() is not None, "the server to come up")
        assert proc.poll() is None, log.read_text()[-3000:]
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
        conn.request("POST", "/v1/completions", body=json.dumps({"model": "t-q8", "prompt": "lo ki", "max_tokens": 200,
                                                                 "stream": True}),
                     headers={"Content-Type": "application/json"})
        body = conn.getresponse().read().decode()
        code = proc.wait(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    cause = "cannot re-form the pipeline: RuntimeError: no launcher of MPICH"
    last = json.loads([line for line in body.splitlines() if line.startswith("data: {")][-1][6:])
    assert last["error"]["message"] == f"the pipeline failed: {cause}", body[-2000:]
    text = log.read_text()
    errors = [line for line in text.splitlines() if line.startswith("pipeinfer: error:")]
    assert code == 1 and errors == [f"pipeinfer: error: the pipeline failed: {cause}"], text[-3000:]
    assert "Traceback" not in text


def _health(port: int) -> dict | None:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    except (OSError, ValueError):
        return None


def _serve_with(spec: str, argv: list[str]) -> None:
    """The pipeinfer CLI with launch.launch_command a FakeLauncher (spec: FakeLauncher.from_json)."""
    from pipeinfer.cli.main import entry
    from pipeinfer.supervisor import launch
    launch.launch_command = FakeLauncher.from_json(spec)
    sys.argv = ["pipeinfer", *argv]
    entry()


if __name__ == "__main__":
    if sys.argv[1] == "rank0":
        sock_path, hosts, fail_after, n_jobs_first, garble = sys.argv[2:7]
        fake_rank0(sock_path, hosts.split(","), int(fail_after) or None, int(n_jobs_first), garble == "garble")
    elif sys.argv[1] == "serve-with":
        _serve_with(sys.argv[2], sys.argv[3:])
