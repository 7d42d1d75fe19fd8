"""The head's live one-line status on a terminal: tokens, speed, acceptance, runs in flight.

When the generated text streams to the same terminal, the status keeps the terminal's last row to itself:
the rows above it become the scroll region (DECSTBM), so text scrolls above a fixed status line, the way
apt draws its progress bar. When the text goes to a file or a pipe, the status is a single stderr line
redrawn in place. Nothing is drawn when stderr is not a terminal.
"""
from __future__ import annotations

import os
import time
from typing import TextIO

SAVE, RESTORE = "\x1b7", "\x1b8"  # cursor save/restore (DEC), kept across a scroll-region change
CLEAR_LINE = "\x1b[2K"
MIN_ROWS = 3                      # a smaller terminal gets no reserved row


def status_text(n_generated: int, tokens_per_s: float, acceptance: float, n_in_flight: int) -> str:
    return (f"[pipeinfer] {n_generated} tokens, {tokens_per_s:.2f} tokens/s, "
            f"acceptance {acceptance * 100:.0f}%, {n_in_flight} runs in flight")


class StatusLine:
    """Call it with (stats, runs in flight) after each emission; close() when generation ends.

    reserve_row: the text shares the terminal, so the last row is taken out of the scroll region.
    """

    def __init__(self, err: TextIO, reserve_row: bool, min_interval_s: float = 0.25):
        self.err = err
        self.min_interval_s = min_interval_s
        self._last_draw_s = 0.0
        self._rows = 0                      # terminal height the scroll region was set for; 0: none set
        self.reserve_row = reserve_row
        if reserve_row:
            self._reserve(self._terminal_rows())

    @classmethod
    def for_streams(cls, out: TextIO, err: TextIO) -> StatusLine | None:
        """The right kind of status line for where text (out) and status (err) go; None when err is no tty."""
        if not err.isatty():
            return None
        return cls(err, reserve_row=out.isatty())

    def _terminal_rows(self) -> int:
        try:
            return os.get_terminal_size(self.err.fileno()).lines
        except (OSError, ValueError):
            return 0

    def _reserve(self, rows: int) -> None:
        if rows < MIN_ROWS:
            return
        # a new line first, so that a cursor on the last row moves up out of the row being reserved;
        # setting the region homes the cursor, hence the save/restore around it
        self.err.write(f"\n\x1b[1A{SAVE}\x1b[1;{rows - 1}r{RESTORE}")
        self.err.flush()
        self._rows = rows

    def __call__(self, stats, n_in_flight: int) -> None:
        now = time.perf_counter()
        if now - self._last_draw_s < self.min_interval_s:
            return
        self._last_draw_s = now
        self.draw(status_text(stats.n_generated, stats.gen_tokens_per_s, stats.acceptance_rate, n_in_flight))

    def draw(self, text: str) -> None:
        if not self.reserve_row:
            self.err.write(f"\r{CLEAR_LINE}{text}")
        else:
            rows = self._terminal_rows()
            if rows != self._rows:          # resized: move the reserved row to the new bottom
                self._release()
                self._reserve(rows)
            if not self._rows:
                return
            self.err.write(f"{SAVE}\x1b[{self._rows};1H{CLEAR_LINE}{text}{RESTORE}")
        self.err.flush()

    def _release(self) -> None:
        if self._rows:
            self.err.write(f"{SAVE}\x1b[{self._rows};1H{CLEAR_LINE}\x1b[r{RESTORE}")
            self._rows = 0

    def close(self) -> None:
        """Erase the status and give the terminal its whole height back."""
        if self.reserve_row:
            self._release()
        else:
            self.err.write(f"\r{CLEAR_LINE}")
        self.err.flush()

