"""Rank 0's end of a supervised server without a pipeline: a fake head session whose scheduler answers every
request with letters (token i of an answer is letter i), and `attach_rank0`, the real run_attached over a Unix
socket: what the link's and the supervisor's tests talk to."""
from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from pipeinfer.core.metrics import Stats
from pipeinfer.core.topology import LayerRange
from pipeinfer.core.sampling import SamplingParams

WAIT_S = 20.0


def letter(position: int) -> int:
    return ord("a") + position % 26


class LetterTokenizer:
    def piece(self, token: int) -> bytes:
        return bytes([token % 256])


@dataclass
class FakeRequest:
    prompt: list[int]
    n_predict: int
    sampling: SamplingParams
    prompt_text: str | None
    chat: bool
    on_tokens: object
    should_stop: object
    on_done: object
    replay: list[int]
    out: list[int] = field(default_factory=list)


class FakeScheduler:
    """What run_attached uses of decide.scheduler.Scheduler: each step gives every request its next token (letter i
    at position i of the answer, the replayed ones counted); a prompt over 8 tokens does not fit (ValueError)."""

    def __init__(self):
        self.waiting: list = []
        self.running: list[FakeRequest] = []
        self.n_steps = 0

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def has_idle_work(self) -> bool:
        return False

    def idle_work(self) -> bool:
        return False

    def submit(self, req: FakeRequest) -> None:
        if len(req.prompt) > 8:
            raise ValueError(f"prompt ({len(req.prompt)} tokens) does not fit")
        self.running.append(req)

    def step(self) -> None:
        self.n_steps += 1
        for req in list(self.running):
            if req.should_stop() or len(req.out) == req.n_predict:
                self.running.remove(req)
                req.on_done(req.out, Stats(n_generated=len(req.out)))
            else:
                req.out.append(letter(len(req.replay) + len(req.out)))
                req.on_tokens(req.out[-1:])
        time.sleep(0.001)


class FakeSession:
    """What run_attached uses of a head session (ranks/session.py), without a pipeline."""
    live = None
    ranges = [LayerRange(0, 2), LayerRange(2, 4)]
    parallel = 3

    def __init__(self):
        self.sched, self.requests = FakeScheduler(), []
        self.waited_s = 0.0

    def scheduler(self) -> FakeScheduler:
        return self.sched

    def load(self) -> dict:
        return {"prompt_cache": None}

    def poll_stages(self, waited_s: float = 0.0) -> None:
        self.waited_s += waited_s

    def stages(self) -> list[dict]:
        """Two stages whose counters grow with the steps taken (HeadSession.stages' shape)."""
        n = self.sched.n_steps
        return [{"rank": r, "host": "box", "n_reports": n, "n_decoded": n, "n_tokens": 2 * n, "n_cancelled_before": 0,
                 "n_cancelled_mid": 0, "n_kv_txns": 0, "t_busy_s": 0.01 * n, "t_idle_s": self.waited_s,
                 "bytes_sent": 100 * n} for r in (0, 1)]

    def request(self, prompt, *, n_predict, sampling, prompt_text, chat, on_tokens, should_stop, on_done,
                replay=(), decoding=None, on_logprobs=None, cache_prompt=True) -> FakeRequest:
        self.requests.append(FakeRequest(list(prompt), n_predict, sampling, prompt_text, chat, on_tokens,
                                         should_stop, on_done, list(replay)))
        return self.requests[-1]


def outcome(job):
    assert job.finished.wait(WAIT_S), "the request was left waiting"
    return job.outcome


def attach_rank0(tmp_path, session):
    """run_attached(session) in a thread, connected over a Unix socket in tmp_path: (listener, the accepted
    connection for a Supervisor, the rank-0 thread)."""
    from pipeinfer.feeders.attach import run_attached
    path = str(tmp_path / "rank0.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    listener.settimeout(WAIT_S)
    stop = SimpleNamespace(requested=False)
    rank0 = threading.Thread(target=run_attached, args=(session, path, stop), daemon=True)
    rank0.start()
    conn, _ = listener.accept()
    return listener, conn, rank0
