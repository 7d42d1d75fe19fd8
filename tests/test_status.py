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

from pipeinfer.status import StatusLine, status_text


class FakeTerminal(io.StringIO):
    def __init__(self, tty: bool, rows: int = 24):
        super().__init__()
        self.tty, self.rows = tty, rows

    def isatty(self):
        return self.tty


@pytest.fixture
def rows(monkeypatch):
    size = {"rows": 24}
    monkeypatch.setattr("pipeinfer.status.os.get_terminal_size",
                        lambda fd: os.terminal_size((80, size["rows"])))
    monkeypatch.setattr(FakeTerminal, "fileno", lambda self: 2, raising=False)
    return size


STATS = SimpleNamespace(n_generated=12, gen_tokens_per_s=3.5, acceptance_rate=0.75)


def test_no_status_without_a_terminal():
    assert StatusLine.for_streams(FakeTerminal(True), FakeTerminal(False)) is None


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
    status = StatusLine(err, reserve_row=False, min_interval_s=3600)
    status(STATS, 1)
    status(STATS, 1)
    assert err.getvalue().count("tokens/s") == 1


def test_resize_moves_the_reserved_row(rows):
    err = FakeTerminal(True)
    status = StatusLine(err, reserve_row=True)
    rows["rows"] = 40
    err.truncate(0), err.seek(0)
    status.draw("x")
    out = err.getvalue()
    assert "\x1b[r" in out and "\x1b[1;39r" in out and out.endswith("\x1b[40;1H\x1b[2Kx\x1b8")


def test_tiny_terminal_gets_no_region(rows):
    rows["rows"] = 2
    err = FakeTerminal(True)
    status = StatusLine(err, reserve_row=True)
    status.draw("x")
    status.close()
    assert err.getvalue() == ""


@pytest.mark.mpi
def test_cli_on_a_terminal_streams_text_above_the_status(models):
    """The real CLI with stdout and stderr on one pseudo-terminal of 30 rows."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    cmd = [sys.executable, "-m", "pipeinfer", "generate", "-m", str(models["f32"]), "-p", "hi", "-n", "12",
           "--ignore-eos", "--mode", "pipeinfer", "--draft", str(models["draft90"])]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, close_fds=True)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:       # EIO: the child closed the terminal
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
    assert "tokens/s" in out.split("\x1b[r")[-1]          # the final statistics come after
