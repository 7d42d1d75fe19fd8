"""A requested stop (SIGINT, SIGTERM) is a clean end, not a failure: `generate` prints the text so far and its
statistics and exits 0, `serve` finishes and exits 0, and the liveness hub names no rank as lost, under MPICH's
mpiexec (tests/test_openmpi.py runs the same under Open MPI). The pure part, which signal `pipeinfer launch` passes
on to which MPI's launcher, is tested in tests/test_launch.py.
"""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import MPIEXEC, ROOT

sys.path.insert(0, str(ROOT / "launch"))
import failures as F  # noqa: E402

pytestmark = pytest.mark.mpi
PY = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer"]


N_LONG = 8000  # tokens: 14 s at the 590 tokens/s 2 ranks reach on the big synthetic model here, a signal comes sooner


def long_generation(model: Path, results: Path) -> list[str]:
    """`pipeinfer generate` arguments for a generation that streams for far longer than a test waits."""
    return ["generate", "-p", "hi", "--ignore-eos", "-t", "1", "-m", str(model), "-n", str(N_LONG), "-c", "8192",
            "--mode", "pipeinfer", "--drafter", "ngram", "--results", str(results)]


class Job:
    """A command started in a session of its own (as from a terminal), its stdout and stderr in files."""

    def __init__(self, cmd: list[str], tmp: Path, env: dict | None = None, tag: str | None = None):
        self.out, self.err = tmp / "out.txt", tmp / "err.txt"
        self.tag = tag or os.urandom(8).hex()
        env = dict(env or os.environ, PIPEINFER_FAULT_TAG=self.tag)  # F._rank_pids finds the ranks by it
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=tmp, start_new_session=True)

    def wait_for_text(self, n_bytes: int = 200, timeout: float = 120, after_first_line: bool = False) -> None:
        """Until n_bytes of text are on stdout (with after_first_line, after `pipeinfer launch`'s command line)."""
        deadline = time.monotonic() + timeout

        def n_text() -> int:
            text = self.out.read_bytes()
            return len(text.partition(b"\n")[2]) if after_first_line else len(text)
        while n_text() < n_bytes:
            assert self.proc.poll() is None, f"ended with {self.proc.returncode} before any text:\n{self.stderr()}"
            assert time.monotonic() < deadline, f"no text after {timeout} s:\n{self.stderr()}"
            time.sleep(0.05)

    def signal_rank(self, rank: int, sig: int) -> None:
        os.kill(F._rank_pids(self.tag)[rank], sig)

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            for pid in F._rank_pids(self.tag).values():
                os.kill(pid, signal.SIGKILL)
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


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return F.make_models(tmp_path_factory.mktemp("stopmodels"))["big"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_mpiexec_stops_generate_cleanly(big, tmp_path, sig):
    results = tmp_path / "results.csv"
    job = Job([MPIEXEC, "-n", "2"] + PY + long_generation(big, results), tmp_path)
    job.wait_for_text()
    os.kill(job.proc.pid, sig)  # mpiexec forwards it to every rank
    assert job.finish() == 0, job.stderr()[-3000:]
    assert_clean_stop(job, results, signal.Signals(sig).name)


def test_a_signal_to_one_worker_stops_the_whole_job(big, tmp_path):
    results = tmp_path / "results.csv"
    job = Job([MPIEXEC, "-n", "3"] + PY + long_generation(big, results), tmp_path)
    job.wait_for_text()
    job.signal_rank(2, signal.SIGTERM)  # that rank alone: it tells the hub, which tells rank 0
    assert job.finish() == 0, job.stderr()[-3000:]
    assert_clean_stop(job, results, "SIGTERM on rank 2")


def test_a_rank_killed_after_a_stop_is_no_failure(big, tmp_path):
    # Open MPI's mpirun kills its ranks 1 s after its SIGTERM: the hub must not call that a lost rank
    results = tmp_path / "results.csv"
    job = Job([MPIEXEC, "-n", "3"] + PY + long_generation(big, results), tmp_path)
    job.wait_for_text()
    job.signal_rank(1, signal.SIGTERM)
    time.sleep(0.3)
    job.signal_rank(1, signal.SIGKILL)
    job.finish()  # mpiexec ends the job its own way (code 9), or the head finished first (0)
    assert "was lost" not in job.stderr() and "pipeinfer: error" not in job.stderr(), job.stderr()[-3000:]


class ServeJob(Job):
    """`LAUNCHER... pipeinfer serve` on a free loopback port, the big synthetic model, up and answering."""

    def __init__(self, launcher: list[str], model: Path, tmp: Path, env: dict | None = None, timeout: float = 120):
        from test_serve import free_port
        self.port = free_port()
        super().__init__(launcher + ["serve", "--port", str(self.port), "-m", str(model), "--drafter", "ngram",
                                     "-t", "1", "-c", "4096", "--alias", "synthetic"], tmp, env)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            assert self.proc.poll() is None, f"serve ended with {self.proc.returncode}:\n{self.stderr()[-3000:]}"
            assert time.monotonic() < deadline, f"serve not up after {timeout} s:\n{self.stderr()[-3000:]}"
            time.sleep(0.2)

    def _healthy(self) -> bool:
        import http.client
        try:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False

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
            or "[pipeinfer] stopping: the pipeline's job finishes the requests in progress" in err), err[-3000:]  # supervised
    assert "pipeinfer: error" not in err and "Traceback" not in err and "was lost" not in err, err[-3000:]


def test_serve_finishes_the_request_in_progress_on_sigterm(big, tmp_path):
    job = ServeJob([MPIEXEC, "-n", "2"] + PY, big, tmp_path)
    text, finish = job.stream_while(lambda: os.kill(job.proc.pid, signal.SIGTERM))
    assert finish == "length" and len(text) > 300, (finish, text[-200:])  # the whole answer, then the end
    assert job.finish() == 0, job.stderr()[-3000:]
    assert_served_and_stopped(job)
    assert "300 tokens" in job.stderr()  # its log line: every token was generated


def test_launch_passes_ctrl_c_on_once(big, tmp_path):
    """`pipeinfer launch` in a terminal: Ctrl-C reaches the launcher alone (mpiexec runs in a session of its own),
    which passes one SIGINT on: mpiexec forwards it to the ranks, which stop cleanly (a second SIGINT, from the
    terminal and the launcher both, would be MPICH's forced abort)."""
    results = tmp_path / "results.csv"
    (tmp_path / "hosts").write_text("localhost:2 # pipeinfer: threads=1\n")
    job = Job([sys.executable, "-m", "pipeinfer", "launch", "--hostfile", "hosts", "--"]
              + long_generation(big, results), tmp_path)
    job.wait_for_text(after_first_line=True)  # the launch line, then text
    os.killpg(job.proc.pid, signal.SIGINT)  # the terminal signals its foreground process group
    assert job.finish() == 0, job.stderr()[-3000:]
    assert_clean_stop(job, results, "SIGINT")
