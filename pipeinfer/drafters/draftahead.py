"""The draft beside the pipeline: a drafter that drafts ahead on the speculation chain, asynchronously.

With the draft in series (the default `--draft-at head`) the head drafts each micro-batch itself, between
its stage's decodes: every draft token delays the pipeline. Here the drafter runs beside it, in a thread of
rank 0 (`--draft-at thread`, its llama.cpp calls release the GIL) or on an MPI rank of its own (`--draft-at
rank`: the world's last rank, so a weak machine can carry the draft), and the head only reads what it has
drafted so far:

    head (DraftClient)                               drafter (DraftService)
    BEGIN(prompt, text)                         ->   a new generation: prefill the prompt
    STEER(epoch, n_keep, tokens, horizon, p_min) ->  context := context[:n_keep] + tokens; draft on it
                                                <-   PROPOSAL(epoch, pos, tokens, probs, stopped) per call
    END                                         ->   the session is over
                                                <-   PROPOSAL(CLOSED_EPOCH): nothing follows (the head drains to it)

The drafter keeps drafting its own main chain, `n_chunk` tokens per call, until it reaches `horizon` or
it has nothing to propose above `p_min` (the floor of the head's cutoff: -pa, lowered by -pd's decay but
not raised by -pr's recovery, which the next acceptance resets; the head applies its current cutoff when it
launches). A stopped chain resumes when the cutoff falls or the context moves. When verification moves the speculation chain
somewhere the drafter did not go (a rejected draft, a cancelled run), the head re-roots it: a new epoch,
the length of the context both still share (`n_keep`: the drafter rolls its KV back to it, ModelDrafter's
prefix reuse) and the tokens after it. Proposals of an older epoch, or for positions the head no longer
needs, are stale: dropped and counted. The head never waits for a draft: with nothing drafted yet it goes
on (a non-speculative run keeps the pipeline busy, as without a draft).

Layouts (DRAFT_CTRL, PROPOSAL) are declared in protocol.py; a thread drafter passes the same packed arrays
through queues, so both placements run the same code.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..core.protocol import CLOSED_EPOCH, KEEP_ALL, Ctrl, DraftCtrl, Proposal, Tag
from .drafter import Cutoffs, Drafter, DraftNode, main_chain

NO_ALT = (-1, 0.0)  # a position without a runner-up (tokens the head gave)
RETRY_CHUNK = 4  # draft tokens asked for when a shorter chunk proposed nothing (DraftService.step)


# ================================================================ channels: one end of a two-way link
class QueueEnd:
    """One end of an in-process link (the thread placement): packed i32 arrays through two queues."""

    def __init__(self, inbox: queue.Queue, outbox: queue.Queue):
        self.inbox, self.outbox = inbox, outbox
        self.bytes_sent = 0

    def send(self, buf: np.ndarray) -> None:
        self.bytes_sent += buf.nbytes
        self.outbox.put(buf)

    def recv(self, block: bool) -> np.ndarray | None:
        """The next message; with block, wait for one (the drafter, idle); else None when none is waiting."""
        try:
            return self.inbox.get(block=block)
        except queue.Empty:
            return None

    def flush(self) -> None:
        """Sends complete at once here."""


def queue_pair() -> tuple[QueueEnd, QueueEnd]:
    """(head's end, drafter's end) of an in-process link."""
    a, b = queue.Queue(), queue.Queue()
    return QueueEnd(a, b), QueueEnd(b, a)


class MpiEnd:
    """One end of the head <-> draft rank link: a Transport on a communicator of its own (tag-ordered,
    bounded non-blocking sends, polite waiting: see transport.py for why a blocking receive is never used)."""

    def __init__(self, tx, peer: int, tag_out: Tag, tag_in: Tag):
        self.tx, self.peer, self.tag_out, self.tag_in = tx, peer, tag_out, tag_in

    @property
    def bytes_sent(self) -> int:
        return self.tx.bytes_sent

    def send(self, buf: np.ndarray) -> None:
        self.tx.send_i32(self.peer, self.tag_out, buf)

    def recv(self, block: bool) -> np.ndarray | None:
        while (buf := self.tx.try_recv_i32(self.tx.pipe, self.peer, self.tag_in)) is None and block:
            time.sleep(self.tx.poll_s)
        return buf

    def flush(self) -> None:
        self.tx.flush()


# ================================================================ the drafter's side
@dataclass
class ServiceStats:
    n_calls: int = 0
    n_proposed: int = 0
    n_reroots: int = 0
    t_busy_s: float = 0.0


class DraftService:
    """Drafts ahead on the context the head steers it to; `serve` runs until END.

    drafter_for(prompt, text, chat) -> Drafter builds the drafter of a generation (what make_drafter returns).
    """

    def __init__(self, drafter_for: Callable[[list[int], str, bool], Drafter], end, n_ctx: int, n_vocab: int):
        self.drafter_for, self.end, self.n_ctx, self.n_vocab = drafter_for, end, n_ctx, n_vocab
        self.drafter: Drafter | None = None
        self.ctx: list[int] = []   # the context as the head last steered it + what was drafted on it since
        self.epoch = 0
        self.horizon = 0
        self.n_chunk = 1
        self.p_min = 1.0
        self.stopped = False       # the chain's next token is below p_min: wait for the head
        self.stats = ServiceStats()

    def has_work(self) -> bool:
        return self.drafter is not None and not self.stopped and len(self.ctx) < self.horizon

    def serve(self) -> ServiceStats:
        while True:
            buf = self.end.recv(block=not self.has_work())
            while buf is not None:
                msg = DraftCtrl.unpack(buf, self.n_ctx, self.n_vocab)
                if msg.kind == Ctrl.END:
                    self.end.send(Proposal(CLOSED_EPOCH, 0, [], []).pack())
                    return self.stats
                self.apply(msg)
                buf = self.end.recv(block=False)  # take every waiting message before drafting on
            if self.has_work():
                self.step()

    def apply(self, msg: DraftCtrl) -> None:
        if msg.kind == Ctrl.BEGIN:
            self.drafter = self.drafter_for(msg.tokens, msg.text, bool(msg.aux))
            self.drafter.prefill(msg.tokens)
            self.ctx, self.epoch, self.horizon, self.stopped = list(msg.tokens), msg.epoch, 0, False
            return
        if msg.n_keep != KEEP_ALL:  # a re-root: keep what is still valid, continue from the head's tokens
            self.ctx = self.ctx[:msg.n_keep] + msg.tokens
            self.stopped = False
            self.stats.n_reroots += 1
        elif msg.p_min < self.p_min:  # the cutoff fell: the token that stopped the chain may pass now
            self.stopped = False
        self.epoch, self.horizon, self.n_chunk, self.p_min = msg.epoch, msg.horizon, msg.n_chunk, msg.p_min

    def step(self) -> None:
        """One drafter call: up to n_chunk tokens of the main chain after ctx, sent as one PROPOSAL.

        A drafter that proposes nothing for a short chunk is asked once more for RETRY_CHUNK tokens: a
        translating drafter (translating.py) often cannot propose the last token of what it drafted (the next one
        may merge with it), so it needs to draft further to propose anything. When even that gives nothing,
        the chain is stopped until the head moves the context or lowers the cutoff."""
        t0 = time.perf_counter()
        n = max(1, min(max(self.n_chunk, self.drafter.ahead_chunk), self.horizon - len(self.ctx)))
        chain = self._draft(n)
        if not chain and n < RETRY_CHUNK:
            chain = self._draft(RETRY_CHUNK)
        self.stopped = not chain
        self.end.send(Proposal(self.epoch, len(self.ctx), [d.token for d in chain], [d.prob for d in chain],
                               self.stopped, [d.alt for d in chain], [d.alt_prob for d in chain]).pack())
        self.ctx += [d.token for d in chain]
        self.stats.n_proposed += len(chain)
        self.stats.t_busy_s += time.perf_counter() - t0

    def _draft(self, n: int) -> list[DraftNode]:
        self.stats.n_calls += 1
        tree = self.drafter.draft(self.ctx, Cutoffs(self.p_min, 1.0, n, 1))
        return [tree[i] for i in main_chain(tree)][:n]


# ================================================================ the head's side
def common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix; bisection over list-slice comparisons (C speed: the head calls this
    a few times per token on contexts of thousands of tokens)."""
    lo, hi = 0, min(len(a), len(b))  # a[:lo] == b[:lo] holds; the answer is in lo..hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class DraftClient:
    """The head's view of a drafter running beside it. `seq` is the drafter's context as of this epoch (the
    root the head gave it + the proposals received since); the head launches from it what continues its own
    speculation chain."""

    asynchronous = True

    def __init__(self, end, n_ctx: int, n_vocab: int, poll_s: float = 0.0005):
        self.end, self.n_ctx, self.n_vocab, self.poll_s = end, n_ctx, n_vocab, poll_s
        self.epoch = 0
        self.seq: list[int] = []
        self.probs: list[float] = []  # probs[i]: confidence of seq[i] (1.0 for tokens the head gave)
        self.alts: list[tuple[int, float]] = []  # alts[i]: the drafter's runner-up at position i, (-1, 0.0): none
        self.stopped_at: int | None = None  # the drafter's chain ends at this position (unconfident)
        self._sent = (0, 0, 0.0)            # last (horizon, n_chunk, p_min) sent in this epoch
        self.n_stale = 0                    # proposed tokens dropped: their chain no longer existed
        self.n_received = 0
        self.n_calls = 0                    # drafter calls (one PROPOSAL each, empty ones included)
        self.bytes_in = 0                   # PROPOSAL bytes received (the other direction: bytes_out)
        self.remote = isinstance(end, MpiEnd)  # a network link (--draft-at rank), not a thread's queues
        self.exact_batch = None
        self.check: Callable[[], None] | None = None  # raises the drafter's error (thread placement)
        self.level_source: Callable[[], list] | None = None  # a hierarchy's counts per level (thread placement)

    @property
    def bytes_out(self) -> int:
        """Control bytes sent to the drafter."""
        return self.end.bytes_sent

    # ---- steering
    def begin(self, prompt: list[int], text: str = "", chat: bool = False) -> None:
        """A new generation: the drafter prefills the prompt while the target's stages do."""
        self.epoch += 1
        self.end.send(DraftCtrl(Ctrl.BEGIN, self.epoch, 0, list(prompt), aux=int(chat), text=text or "").pack())
        self.seq, self.probs, self.stopped_at, self._sent = list(prompt), [1.0] * len(prompt), None, (0, 0, 0.0)
        self.alts = [NO_ALT] * len(prompt)

    def prefill(self, prompt: list[int]) -> None:
        if self.seq != list(prompt):
            self.begin(prompt)

    def steer(self, target: list[int], horizon: int, p_min: float, n_chunk: int) -> None:
        """Have the drafter draft on `target` (re-rooting it when target is not a prefix of what it drafted)
        up to `horizon`, n_chunk tokens per call, stopping below p_min. Sends only what changed."""
        self.poll()
        c = common_prefix(target, self.seq)
        horizon = min(horizon, self.n_ctx)
        # re-root where the drafter went another way, or stopped short of target; where it is only behind (seq a
        # prefix of target), let it go on: its next proposal most likely is target's next token, and drafting
        # that again from a new root would cost the same time. A wrong proposal diverges, and re-roots then.
        behind = c == len(self.seq) and self.stopped_at != len(self.seq)
        if c < len(target) and not behind:
            self.epoch += 1
            self.end.send(DraftCtrl(Ctrl.STEER, self.epoch, c, target[c:], horizon, n_chunk, p_min).pack())
            self.seq, self.probs = list(target), self.probs[:c] + [1.0] * (len(target) - c)
            self.alts = self.alts[:c] + [NO_ALT] * (len(target) - c)
            self.stopped_at, self._sent = None, (horizon, n_chunk, p_min)
        elif (horizon, n_chunk, p_min) != self._sent:
            self.end.send(DraftCtrl(Ctrl.STEER, self.epoch, KEEP_ALL, [], horizon, n_chunk, p_min).pack())
            if p_min < self._sent[2]:
                self.stopped_at = None
            self._sent = (horizon, n_chunk, p_min)

    def close(self) -> None:
        """END the session. Over MPI, take every proposal still on its way, up to the drafter's CLOSED answer: a
        message left unreceived at MPI_Finalize makes UCX print warnings on stdout (into --json output)."""
        self.end.send(DraftCtrl(Ctrl.END).pack())
        if not self.remote:
            return
        self.end.flush()
        while True:
            buf = self.end.recv(block=True)  # polite; a draft rank that died is named by liveness.py
            if Proposal.unpack(buf, self.n_ctx, self.n_vocab).epoch == CLOSED_EPOCH:
                return

    def offer(self, tail: tuple[int, int], pos: int, token: int, prob: float) -> None:
        """A proposal of the target's MTP head: a drafter beside the pipeline drafts its own."""

    def levels(self) -> list:
        """A hierarchy's counts per level, read from the drafter's thread; over a draft rank's link: not reported."""
        return self.level_source() if self.level_source is not None else []

    # ---- reading
    def poll(self) -> int:
        """Take every proposal waiting; returns how many changed what the head can launch (tokens that joined
        `seq`, and the end of the drafter's chain)."""
        if self.check is not None:
            self.check()
        n_new = 0
        while (buf := self.end.recv(block=False)) is not None:
            self.bytes_in += buf.nbytes
            p = Proposal.unpack(buf, self.n_ctx, self.n_vocab)
            self.n_received += len(p.tokens)
            self.n_calls += 1
            if p.epoch != self.epoch or p.pos != len(self.seq):
                self.n_stale += len(p.tokens)
                continue
            self.seq += p.tokens
            self.probs += p.probs
            self.alts += list(zip(p.alts, p.alt_probs))
            n_new += len(p.tokens)
            if p.stopped:
                self.stopped_at = len(self.seq)
                n_new += 1
        return n_new

    def ready(self, context: list[int], p_accept: float, n_max: int) -> tuple[list[DraftNode], bool]:
        """(chain, unconfident): the drafted tokens after `context` with confidence >= p_accept, at most n_max;
        unconfident when the drafter's chain stops (or falls below p_accept) right after `context`."""
        m = len(context)
        if self.seq[:m] != context:
            return [], False
        nodes = []
        for k in range(min(n_max, len(self.seq) - m)):
            if self.probs[m + k] < p_accept:
                break
            nodes.append(DraftNode(self.seq[m + k], k - 1, k, {0}, self.probs[m + k], *self.alts[m + k]))
        unconfident = not nodes and ((len(self.seq) > m and self.probs[m] < p_accept) or self.stopped_at == m)
        return nodes, unconfident

    def wait(self, until: Callable[[], bool]) -> None:
        """Sleep politely until a proposal arrives or until() holds."""
        while not until():
            if self.poll():
                return
            time.sleep(self.poll_s)

    def draft(self, context: list[int], cut: Cutoffs) -> list[DraftNode]:
        """Synchronous use (speculative mode, tests): steer to context, wait for cut.n_max tokens or the end of
        the confident chain (with each token's runner-up: the head makes siblings of them, decide/shape.py)."""
        while True:
            self.steer(context, len(context) + cut.n_max, cut.p_accept, cut.n_max)  # again: re-roots a divergence
            nodes, unconfident = self.ready(context, cut.p_accept, cut.n_max)
            end = len(context) + len(nodes)
            if len(nodes) == cut.n_max or unconfident or self.stopped_at == end or \
                    (len(self.seq) > end and self.probs[end] < cut.p_accept):
                return nodes
            self.wait(lambda: False)


# ================================================================ placements
DRAFT_NICE = int(os.environ.get("PIPEINFER_DRAFT_NICE", "19"))  # 0: the draft competes with the stages as an equal


def lower_priority() -> None:
    """Run the calling thread (and the llama.cpp threads it starts) at the lowest CPU priority.

    Beside the pipeline on a host whose cores the stages use, the draft should take only the cycles the stages
    leave idle: with 2 stages of Qwen2.5-1.5B on 2 cores and the Gemma draft in a thread, nice 19 gave 9.35 and
    9.54 tokens/s where nice 0 gave 8.75 and 8.76 (launch/bench/bench_draft_layout.py). On a host of
    its own it changes nothing. Linux sets the nice value per thread (a thread id is a PRIO_PROCESS target);
    elsewhere this is a no-op."""
    if DRAFT_NICE == 0:
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), DRAFT_NICE)
    except (AttributeError, OSError):
        pass


class ThreadDrafter:
    """--draft-at thread: a DraftService in a daemon thread of rank 0, behind a DraftClient."""

    def __init__(self, drafter_for, n_ctx: int, n_vocab: int, poll_s: float = 0.0005):
        head_end, service_end = queue_pair()
        self.service = DraftService(drafter_for, service_end, n_ctx, n_vocab)
        self.client = DraftClient(head_end, n_ctx, n_vocab, poll_s)
        self.client.check = self.check
        self.client.level_source = self.levels
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="pipeinfer-draft", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        lower_priority()
        try:
            self.service.serve()
        except BaseException as e:  # re-raised on the head's thread (check), which reports it
            self.error = e

    def levels(self) -> list:
        """A hierarchy's counts per level (stack.py; read from the head's thread while it may draft on), else []."""
        return self.service.drafter.levels() if self.service.drafter is not None else []

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        self.client.close()
        self._thread.join(timeout=30)
