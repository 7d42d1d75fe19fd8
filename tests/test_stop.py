"""A requested stop (SIGINT, SIGTERM) is a clean end, not a failure: `generate` prints the text so far and its
statistics and exits 0, `serve` finishes and exits 0, and the liveness hub names no rank as lost, under MPICH's
mpiexec (tests/test_openmpi.py runs the same under Open MPI). The pure part, which signal `pipeinfer launch` passes
on to which MPI's launcher, is tested in tests/test_launch.py.
"""
import os
import signal
import sys

import pytest

from helpers import (MPIEXEC, PY, Job, ServeJob, assert_clean_stop, assert_served_and_stopped, long_generation,
                     make_big_model, wait_until)

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    return make_big_model(tmp_path_factory.mktemp("stopmodels"))


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
    # Open MPI's mpirun kills its ranks 1 s after its SIGTERM: the hub must not call that a lost rank. The kill comes
    # once the hub has the stop (its debug log says so), whatever the load delays it by
    results, hub_log = tmp_path / "results.csv", tmp_path / "liveness.log"
    job = Job([MPIEXEC, "-n", "3"] + PY + long_generation(big, results), tmp_path,
              dict(os.environ, PIPEINFER_LIVENESS_LOG=str(hub_log)))
    job.wait_for_text()
    job.signal_rank(1, signal.SIGTERM)
    wait_until(lambda: hub_log.exists() and "hub: rank 1 asked to stop" in hub_log.read_text(), 60,
               lambda: f"the hub never had rank 1's stop:\n{job.stderr()[-3000:]}", every=0.02)
    job.signal_rank(1, signal.SIGKILL)  # (within the hub's 0.5 s grace before it passes the stop to rank 0)
    job.finish()  # mpiexec ends the job its own way (code 9), or the head finished first (0)
    assert "was lost" not in job.stderr() and "pipeinfer: error" not in job.stderr(), job.stderr()[-3000:]


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
    job.wait_for_text()  # (the launch line goes to stderr)
    os.killpg(job.proc.pid, signal.SIGINT)  # the terminal signals its foreground process group
    assert job.finish() == 0, job.stderr()[-3000:]
    assert_clean_stop(job, results, "SIGINT")
