"""The head's live one-line status on a terminal: tokens, speed, acceptance, runs in flight.

When the generated text streams to the same terminal, the status keeps the terminal's last row to itself:
the rows above it become the scroll region (DECSTBM), so text scrolls above a fixed status line, the way
apt draws its progress bar. When the text goes to a file or a pipe, the status is a single stderr line
redrawn in place. Nothing is drawn when no terminal is in sight.

Under mpiexec a rank's stdout and stderr are pipes to the launcher (Hydra also starts ranks in a session
of their own, so there is no /dev/tty either). Rank 0 then looks for the launcher among its ancestors on
this host: if mpiexec writes both its stdout and stderr to one terminal, the status goes into rank 0's
stdout, in order with the text, and the terminal's height is read from that terminal's device.
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Callable, TextIO

SAVE, RESTORE = "\x1b7", "\x1b8"  # cursor save/restore (DEC), kept across a scroll-region change
CLEAR_LINE = "\x1b[2K"
MIN_ROWS = 3                      # a smaller terminal gets no reserved row
MAX_ANCESTORS = 8                 # rank -> hydra_pmi_proxy -> mpiexec: the launcher is close
LAUNCHERS = frozenset({"mpiexec", "mpiexec.hydra", "mpirun", "orterun", "prterun"})


def status_text(n_generated: int, tokens_per_s: float, acceptance: float, n_in_flight: int) -> str:
    return (f"[pipeinfer] {n_generated} tokens, {tokens_per_s:.2f} tokens/s, "
            f"acceptance {acceptance * 100:.0f}%, {n_in_flight} runs in flight")


def fd_rows(fd: int) -> int:
    try:
        return os.get_terminal_size(fd).lines
    except (OSError, ValueError):
        return 0


def tty_rows(path: str) -> int:
    """Height of the terminal device at path (0 if it cannot be opened or is no terminal)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOCTTY | os.O_NONBLOCK)
    except OSError:
        return 0
    try:
        return fd_rows(fd)
    finally:
        os.close(fd)


def launcher_tty(proc: Path = Path("/proc"), pid: int | None = None) -> str | None:
    """The terminal the MPI launcher among this process's ancestors writes its stdout and stderr to, if
    both go to the same one (Linux /proc; None elsewhere, on another host, or when they are redirected)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(MAX_ANCESTORS):
        if pid <= 1:
            return None
        try:
            comm = (proc / str(pid) / "comm").read_text().strip()
            if comm in LAUNCHERS:
                out, err = (os.readlink(proc / str(pid) / "fd" / str(fd)) for fd in (1, 2))
                is_tty = out.startswith("/dev/pts/") or out.startswith("/dev/tty")
                return out if is_tty and out == err else None
            stat = (proc / str(pid) / "stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4 (ppid), after the command name
        except (OSError, ValueError, IndexError):
            return None
    return None


class StatusLine:
    """Call it with (stats, runs in flight) after each emission; close() when generation ends.

    stream: where the status is written; rows: the terminal's current height;
    reserve_row: the text shares the terminal, so the last row is taken out of the scroll region.
    """

    def __init__(self, stream: TextIO, reserve_row: bool, rows: Callable[[], int], min_interval_s: float = 0.25):
        self.stream = stream
        self.rows = rows
        self.min_interval_s = min_interval_s
        self._last_draw_s: float | None = None  # None: never drawn (the monotonic clock may be near 0 after boot)
        self._rows = 0                      # terminal height the scroll region was set for; 0: none set
        self.reserve_row = reserve_row
        if reserve_row:
            self._reserve(self.rows())

    @classmethod
    def for_streams(cls, out: TextIO, err: TextIO, under_mpiexec: bool = False) -> StatusLine | None:
        """The right kind of status line for where text (out) and status (err) go, or None."""
        if err.isatty():
            return cls(err, reserve_row=out.isatty(), rows=lambda: fd_rows(err.fileno()))
        tty = launcher_tty() if under_mpiexec else None
        if tty is not None and tty_rows(tty) >= MIN_ROWS:
            return cls(out, reserve_row=True, rows=lambda: tty_rows(tty))
        return None

    def _reserve(self, rows: int) -> None:
        if rows < MIN_ROWS:
            return
        # a new line first, so that a cursor on the last row moves up out of the row being reserved;
        # setting the region homes the cursor, hence the save/restore around it
        self.stream.write(f"\n\x1b[1A{SAVE}\x1b[1;{rows - 1}r{RESTORE}")
        self.stream.flush()
        self._rows = rows

    def __call__(self, stats, n_in_flight: int) -> None:
        now = time.perf_counter()
        if self._last_draw_s is not None and now - self._last_draw_s < self.min_interval_s:
            return
        self._last_draw_s = now
        self.draw(status_text(stats.n_generated, stats.gen_tokens_per_s, stats.acceptance_rate, n_in_flight))

    def draw(self, text: str) -> None:
        if not self.reserve_row:
            self.stream.write(f"\r{CLEAR_LINE}{text}")
        else:
            rows = self.rows()
            if rows != self._rows:          # resized: move the reserved row to the new bottom
                self._release()
                self._reserve(rows)
            if not self._rows:
                return
            self.stream.write(f"{SAVE}\x1b[{self._rows};1H{CLEAR_LINE}{text}{RESTORE}")
        self.stream.flush()

    def _release(self) -> None:
        if self._rows:
            self.stream.write(f"{SAVE}\x1b[{self._rows};1H{CLEAR_LINE}\x1b[r{RESTORE}")
            self._rows = 0

    def close(self) -> None:
        """Erase the status and give the terminal its whole height back."""
        if self.reserve_row:
            self._release()
        else:
            self.stream.write(f"\r{CLEAR_LINE}")
        self.stream.flush()
