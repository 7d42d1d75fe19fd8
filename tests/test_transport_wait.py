"""Waiting for a message: a message is seen at the first look after it came (real MPI), and the poll schedule
probes finely only around when the next header is due (pure logic)."""
import json
import math
import subprocess
import sys

import pytest

from helpers import MPIEXEC, ROOT
from pipeinfer.wire.transport import FINE_LEAD_S, FINE_POLL_S, FINE_SPAN_S, ArrivalWindow, poll_sleep_s


@pytest.mark.mpi
def test_a_message_that_came_while_the_rank_slept_is_seen_at_the_first_look():
    cmd = [MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "mpi_probe.py")]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    assert found["arrived"] == found["trials_each"], found  # MPICH's single Iprobe finds none of them (found["iprobe"])


def test_no_window_before_a_wait_was_recorded():
    assert ArrivalWindow().window() == (math.inf, math.inf)
    assert poll_sleep_s(0.0, ArrivalWindow().window(), 5e-4) == 5e-4


def test_window_opens_before_the_usual_arrival_and_is_bounded():
    rhythm = ArrivalWindow()
    for waited in (0.030, 0.031, 0.029, 0.0, 0.030, 0.032, 0.060, 0.030, 0.031):  # 0: the header was there already
        rhythm.record(waited)
    assert len(rhythm.recent) == 8 and 0.0 not in rhythm.recent
    start, until = rhythm.window()
    assert start == pytest.approx(0.030 - FINE_LEAD_S)  # the lower quartile: one slow wait (0.060) moves nothing
    assert until - start == pytest.approx(FINE_SPAN_S)


def test_poll_sleeps_finely_only_inside_the_window_and_never_past_its_start():
    window, coarse = (0.020, 0.025), 5e-4
    assert poll_sleep_s(0.010, window, coarse) == coarse
    assert poll_sleep_s(0.0198, window, coarse) == pytest.approx(0.0002)  # wake up as the window opens
    assert poll_sleep_s(0.021, window, coarse) == FINE_POLL_S
    assert poll_sleep_s(0.026, window, coarse) == coarse  # a late header: back to coarse polling
    assert poll_sleep_s(0.021, window, 1e-5) == 1e-5  # --poll-us below the fine interval wins
