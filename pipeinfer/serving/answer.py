"""One job's answer on its way out: token ids decoded as a stream, stop strings held back and matched, and each
token's log-probabilities sent with the piece of text that completes it.

The alignment rule: text leaves later than its tokens arrive (an unfinished UTF-8 character waits for its last
byte; text that could begin a stop string waits until it cannot), so a token's log-probability entry is sent in
the event that releases the last byte of its text, never before. Offsets are counted in bytes of the tokens'
pieces against the UTF-8 bytes of the text released, so they agree exactly while the answer is valid UTF-8 (an
invalid byte decodes to U+FFFD, three bytes: its entries go out at most that much early, never late). A token
with no text goes out with the next release. Tokens whose text a stop string cuts, wholly or in part, are not
reported; nor, then, is anything after them.

The log-probabilities come from the scheduler's on_logprobs(list[TokenLogprob]), called just before
on_tokens(tokens) with one entry per token, in order (decide/scheduler.Request).
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from ..core.decoding import TokenLogprob
from .job import DoneEvent, TextEvent, time_to_first_token_s

# OpenAI's floor for a log-probability: -inf (a token a constraint forbids) is not JSON
LOGPROB_FLOOR = -9999.0


class StopMatcher:
    """Streams text through, holding back what could be the start of a stop string; `hit` once one matched
    (the text is cut before it)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.held = ""
        self.hit = False

    def feed(self, text: str) -> str:
        if self.hit or not self.stops:
            return "" if self.hit else text
        buf = self.held + text
        cut = min((i for i in (buf.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit, self.held = True, ""
            return buf[:cut]
        keep = 0  # the longest tail of buf that is a proper prefix of some stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.held = ("" if self.hit else self.held), ""
        return out


def token_entry(tok, token: int, logprob: float) -> dict:
    """{token, logprob, bytes}: the token's piece (`token` its UTF-8 decoding, U+FFFD for a partial character)."""
    piece = tok.piece(token)
    floored = float(logprob) if logprob >= LOGPROB_FLOOR else LOGPROB_FLOOR  # (NaN compares false: floored too)
    return {"token": piece.decode("utf-8", errors="replace"), "logprob": floored, "bytes": list(piece)}


def logprob_entry(tok, lp: TokenLogprob) -> dict:
    """OpenAI's chat entry: {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}, ...]}."""
    return {**token_entry(tok, lp.token, lp.logprob), "top_logprobs": [token_entry(tok, t, p) for t, p in lp.top]}


class _Aligned:
    """Log-probability entries waiting for their text to be released (the rule in the module docstring)."""

    def __init__(self, tok):
        self.tok = tok
        self.fresh: deque[TokenLogprob] = deque()      # from on_logprobs, for the tokens on_tokens brings next
        self.held: deque[tuple[int, dict]] = deque()   # (the answer's bytes up to the token's end, its entry)
        self.active = False                            # asked for: on_logprobs came
        self.n_bytes = 0                               # the answer's bytes, as its tokens' pieces
        self.n_released = 0                            # bytes of text released

    def add(self, lps: list[TokenLogprob]) -> None:
        self.active = True
        self.fresh.extend(lps)

    def place(self, tokens: list[int]) -> None:
        if not self.active:
            return
        for t in tokens:
            self.n_bytes += len(self.tok.piece(t))
            if self.fresh:
                self.held.append((self.n_bytes, logprob_entry(self.tok, self.fresh.popleft())))

    def release(self, text: str) -> list[dict] | None:
        """The entries whose text is now out; None when log-probabilities were not asked for."""
        if not self.active:
            return None
        self.n_released += len(text.encode())
        out = []
        while self.held and self.held[0][0] <= self.n_released:
            out.append(self.held.popleft()[1])
        return out


class Answer:
    """One job's text (and log-probabilities) on its way out, as TextEvents, then its DoneEvent."""

    def __init__(self, job, tok, clock: Callable[[], float] = time.perf_counter):
        from ..engine.tokenizer import StreamDecoder
        self.job, self.dec, self.stop = job, StreamDecoder(tok), StopMatcher(job.stops)
        self.lps = _Aligned(tok)
        self.clock = clock  # the clock of job.t_queued_s
        self.t_start_s = clock()

    def on_logprobs(self, lps: list[TokenLogprob]) -> None:
        self.lps.add(lps)

    def on_tokens(self, tokens: list[int]) -> None:
        if tokens and not self.job.t_first_token_s:
            self.job.t_first_token_s = self.clock()
        if (meter := self.job.meter) is not None:  # the web page's counters (state.Meter)
            meter.on_tokens(len(tokens))
        self.lps.place(tokens)
        self._release(self.stop.feed(self.dec.feed(tokens)))

    def _release(self, text: str) -> None:
        entries = self.lps.release(text)
        if text or entries:
            self.job.push(TextEvent(text, entries))

    def should_stop(self) -> bool:
        return self.job.cancelled.is_set() or self.stop.hit

    def finish(self, stats, log, on_done) -> None:
        """The held-back text, the log line, the results row, then `done` (last: by the time a client has its
        whole answer, its log line and results row are written)."""
        job = self.job
        self._release(self.stop.feed(self.dec.flush()) + self.stop.flush())
        finish = "stop" if self.stop.hit or stats.n_generated < job.n_predict else "length"
        if job.cancelled.is_set():
            finish = "cancelled"
        queued = stats.t_queue_s or (self.t_start_s - job.t_queued_s)
        log(f"[serve] {job.request_id}: {len(job.prompt_tokens)} prompt + {stats.n_generated} tokens, "
            f"queued {queued:.2f} s, prompt {stats.t_prompt_done_s - stats.t_start_s:.2f} s, "
            f"ttft {time_to_first_token_s(job):.3f} s, {stats.gen_tokens_per_s:.2f} tokens/s, "
            f"{drafts_said(stats)}, {finish}")
        if on_done is not None:
            on_done(job, stats, finish)
        if (meter := job.meter) is not None:
            meter.on_done(job, stats, finish)
        job.push(DoneEvent(finish, len(job.prompt_tokens), stats.n_generated, stats.n_cached, stats))


def drafts_said(stats) -> str:
    """What the draft did for one answer: its acceptance, or that it drafted nothing (iterative mode, or the pipeline
    kept busy by other requests: the scheduler speculates only where a stage would idle), not "acceptance 0%"."""
    return f"acceptance {stats.acceptance_rate * 100:.0f}%" if stats.n_drafted else "nothing drafted"
