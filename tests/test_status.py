"""The live status line: escape sequences on a fake terminal, and the real CLI under a pseudo-terminal."""
import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios
from types import SimpleNamespace

import pytest

from helpers import MPIEXEC
from pipeinfer.cli.status import StatusLine, launcher_tty, status_text


class FakeTerminal(io.StringIO):
    def __init__(self, tty: bool, rows: int = 24):
        super().__init__()
        self.tty, self.rows = tty, rows

    def isatty(self):
        return self.tty


@pytest.fixture
def rows(monkeypatch):
    size = {"rows": 24}
    monkeypatch.setattr("pipeinfer.cli.status.os.get_terminal_size",
                        lambda fd: os.terminal_size((80, size["rows"])))
    monkeypatch.setattr(FakeTerminal, "fileno", lambda self: 2, raising=False)
    return size


def rows_of(size):
    return lambda: size["rows"]


STATS = SimpleNamespace(n_generated=12, gen_tokens_per_s=3.5, acceptance_rate=0.75)


def test_no_status_without_a_terminal():
    assert StatusLine.for_streams(FakeTerminal(True), FakeTerminal(False)) is None
    assert StatusLine.for_streams(FakeTerminal(False), FakeTerminal(False), under_mpiexec=True) is None  # no launcher


def fake_proc(tmp_path, chain):
    """A /proc with processes (pid, command, stdout target, stderr target), each the parent of the one before."""
    proc = tmp_path / "proc"
    for k, (pid, comm, out, err) in enumerate(chain):
        d = proc / str(pid)
        (d / "fd").mkdir(parents=True)
        (d / "comm").write_text(comm + "\n")
        ppid = chain[k + 1][0] if k + 1 < len(chain) else 1
        (d / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1")
        os.symlink(out, d / "fd" / "1")
        os.symlink(err, d / "fd" / "2")
    return proc


PTS, PIPE = "/dev/pts/7", "pipe:[1234]"


@pytest.mark.parametrize("launcher_out, launcher_err, expected", [
    (PTS, PTS, PTS),                  # mpiexec on a terminal: found
    (PIPE, PIPE, None),               # mpiexec piped (| tee, > file): no status, even though the shell has a tty
    (PTS, "/tmp/log", None),          # 2> log: the status would not share the text's terminal
    ("/dev/pts/7", "/dev/pts/8", None),
])
def test_launcher_tty(tmp_path, launcher_out, launcher_err, expected):
    proc = fake_proc(tmp_path, [(30, "hydra_pmi_proxy", PIPE, PIPE), (20, "mpiexec", launcher_out, launcher_err),
                                (10, "bash", PTS, PTS)])
    assert launcher_tty(proc, pid=30) == expected


def test_launcher_tty_needs_a_launcher(tmp_path):
    proc = fake_proc(tmp_path, [(30, "python", PIPE, PIPE), (10, "bash", PTS, PTS)])
    assert launcher_tty(proc, pid=30) is None
    assert launcher_tty(tmp_path / "no-proc", pid=30) is None


def test_text_elsewhere_redraws_one_line(rows):
    err = FakeTerminal(True)
    status = StatusLine.for_streams(FakeTerminal(False), err)
    status(STATS, 2)
    status.close()
    text = status_text(12, 3.5, 0.75, 2)
    assert err.getvalue() == f"\r\x1b[2K{text}\r\x1b[2K"
    assert "\x1b[1;" not in err.getvalue()  # no scroll region when the text is not on the terminal


def test_shared_terminal_reserves_the_last_row(rows):
    err = FakeTerminal(True)
    status = StatusLine.for_streams(FakeTerminal(True), err)
    assert err.getvalue() == "\n\x1b[1A\x1b7\x1b[1;23r\x1b8"   # rows 1..23 scroll, row 24 is ours
    err.truncate(0), err.seek(0)
    status(STATS, 1)
    assert err.getvalue() == f"\x1b7\x1b[24;1H\x1b[2K{status_text(12, 3.5, 0.75, 1)}\x1b8"
    err.truncate(0), err.seek(0)
    status.close()
    assert err.getvalue() == "\x1b7\x1b[24;1H\x1b[2K\x1b[r\x1b8"       # erased, whole screen scrolls again


def test_redraws_are_throttled(rows):
    err = FakeTerminal(True)
    status = StatusLine(err, reserve_row=False, rows=rows_of(rows), min_interval_s=3600)
    status(STATS, 1)
    status(STATS, 1)
    assert err.getvalue().count("tokens/s") == 1


def test_first_redraw_shows_soon_after_boot(rows, monkeypatch):
    """perf_counter counts from boot on Linux: a machine up for less than min_interval_s still draws."""
    import pipeinfer.cli.status as status_mod
    monkeypatch.setattr(status_mod.time, "perf_counter", lambda: 5.0)
    err = FakeTerminal(True)
    status = StatusLine(err, reserve_row=False, rows=rows_of(rows), min_interval_s=3600)
    status(STATS, 1)
    status(STATS, 1)
    assert err.getvalue().count("tokens/s") == 1


def test_resize_moves_the_reserved_row(rows):
    err = FakeTerminal(True)
    status = StatusLine(err, reserve_row=True, rows=rows_of(rows))
    rows["rows"] = 40
    err.truncate(0), err.seek(0)
    status.draw("x")
    out = err.getvalue()
    assert "\x1b[r" in out and "\x1b[1;39r" in out and out.endswith("\x1b[40;1H\x1b[2Kx\x1b8")


def test_tiny_terminal_gets_no_region(rows):
    rows["rows"] = 2
    err = FakeTerminal(True)
    status = StatusLine(err, reserve_row=True, rows=rows_of(rows))
    status.draw("x")
    status.close()
    assert err.getvalue() == ""


@pytest.mark.mpi
@pytest.mark.parametrize("n_ranks", [None, 2])
def test_cli_on_a_terminal_streams_text_above_the_status(models, n_ranks):
    """The real CLI with stdout and stderr on one pseudo-terminal of 30 rows: alone, and under mpiexec
    (whose ranks see only pipes: rank 0 finds the launcher's terminal)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    cmd = [sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-m", str(models["q8"]), "-p", "hi",
           "-n", "12", "--ignore-eos", "--mode", "pipeinfer", "--draft", str(models["draft90"])]
    if n_ranks:
        cmd = [MPIEXEC, "-n", str(n_ranks)] + cmd
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:       # EIO: every writer closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert p.wait(timeout=120) == 0
    os.close(leader)
    out = b"".join(chunks).decode(errors="replace")
    assert "\x1b[1;29r" in out, out                       # the last row was reserved
    assert "\x1b7\x1b[30;1H\x1b[2K[pipeinfer] " in out    # the status was drawn there
    assert out.rindex("\x1b[r") > out.rindex("tokens/s, acceptance")  # and the terminal given back at the end
    assert "generation speed" in out.split("\x1b[r")[-1]  # the final statistics come after


@pytest.mark.mpi
def test_no_status_when_mpiexec_output_is_piped(models):
    p = subprocess.run([MPIEXEC, "-n", "2", sys.executable, "-m", "mpi4py", "-m", "pipeinfer", "generate", "-m",
                        str(models["f32"]), "-p", "hi", "-n", "6", "--ignore-eos"], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and "\x1b" not in p.stdout + p.stderr
