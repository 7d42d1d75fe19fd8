"""The draft beside the pipeline (draftahead.py): message layouts, re-rooting, stale drafts, and the real Head
scheduling with a drafter in a thread (exact output, cutoffs kept)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pipeinfer.drafters import draftahead
from pipeinfer.drafters.draftahead import DraftClient, DraftService, ThreadDrafter, common_prefix, queue_pair
from pipeinfer.drafters.drafter import Cutoffs, DraftNode, InSeries
from pipeinfer.core.protocol import Ctrl, DraftCtrl, Proposal, ProtocolError
from toy import FakePipeline, ToyDrafter, assert_clean_end, run_head

N_CTX, N_VOCAB = 4096, 1000


class CountingDrafter(InSeries):
    """Proposes (last token + 1) % 100 with confidence conf(pos); records every context it was asked about."""

    def __init__(self, conf=lambda pos: 0.9):
        self.conf = conf
        self.calls: list[tuple[list[int], Cutoffs]] = []
        self.prefilled: list[list[int]] = []

    def prefill(self, prompt):
        self.prefilled.append(list(prompt))

    def draft(self, context, cut):
        self.calls.append((list(context), cut))
        out, last = [], context[-1]
        for k in range(cut.n_max):
            p = self.conf(len(context) + k)
            if p < cut.p_accept:
                break
            last = (last + 1) % 100
            out.append(DraftNode(last, k - 1, k, {0}, p))
        return out


def pump(service: DraftService) -> None:
    """Run the service by hand until it has nothing to do (no thread: the test decides the interleaving)."""
    while True:
        buf = service.end.recv(block=False)
        while buf is not None:
            service.apply(DraftCtrl.unpack(buf, N_CTX, N_VOCAB))
            buf = service.end.recv(block=False)
        if not service.has_work():
            return
        service.step()


def pair(drafter):
    head_end, service_end = queue_pair()
    return DraftClient(head_end, N_CTX, N_VOCAB), DraftService(lambda p, t, c: drafter, service_end, N_CTX, N_VOCAB)


# ---------------------------------------------------------------- layouts
def test_ctrl_and_proposal_round_trip():
    msg = DraftCtrl(Ctrl.STEER, 7, 12, [5, 6, 999], 40, 3, 0.625, 0, "héllo")
    back = DraftCtrl.unpack(msg.pack(), N_CTX, N_VOCAB)
    assert (back.kind, back.epoch, back.n_keep, back.tokens, back.horizon, back.n_chunk, back.text) == \
           (Ctrl.STEER, 7, 12, [5, 6, 999], 40, 3, "héllo")
    assert back.p_min == pytest.approx(0.625)
    p = Proposal(3, 100, [1, 2], [0.5, 0.25], stopped=True, alts=[7, -1], alt_probs=[0.375, 0.0])
    q = Proposal.unpack(p.pack(), N_CTX, N_VOCAB)
    assert (q.epoch, q.pos, q.tokens, q.probs, q.stopped, q.alts, q.alt_probs) == \
           (3, 100, [1, 2], [0.5, 0.25], True, [7, -1], [0.375, 0.0])
    q = Proposal.unpack(Proposal(1, 4, [5], [0.5]).pack(), N_CTX, N_VOCAB)
    assert (q.alts, q.alt_probs) == ([-1], [0.0])   # no runner-up known


@pytest.mark.parametrize("mutate", [
    lambda b: b[:5],                                   # shorter than the header
    lambda b: np.concatenate([b, [1]]).astype(np.int32),  # a payload the header does not announce
    lambda b: b.astype(np.int64),                      # wrong dtype
])
def test_malformed_draft_messages_are_refused(mutate):
    with pytest.raises(ProtocolError):
        DraftCtrl.unpack(mutate(DraftCtrl(Ctrl.STEER, 1, 0, [1, 2], 9, 1, 0.5).pack()), N_CTX, N_VOCAB)
    with pytest.raises(ProtocolError):
        Proposal.unpack(mutate(Proposal(1, 4, [1, 2], [0.5, 0.5]).pack()), N_CTX, N_VOCAB)


def test_out_of_range_draft_messages_are_refused():
    bad_token = DraftCtrl(Ctrl.STEER, 1, 0, [N_VOCAB], 9, 1, 0.5).pack()
    bad_prob = Proposal(1, 4, [1], [0.5]).pack()
    bad_prob[-3] = np.float32(1.5).view(np.int32)
    bad_alt_prob = Proposal(1, 4, [1], [0.5], alts=[2], alt_probs=[0.5]).pack()
    bad_alt_prob[-1] = np.float32(np.nan).view(np.int32)
    bad_alt = Proposal(1, 4, [1], [0.5], alts=[N_VOCAB], alt_probs=[0.5]).pack()
    for buf, unpack in ((bad_token, DraftCtrl.unpack), (bad_prob, Proposal.unpack), (bad_alt_prob, Proposal.unpack),
                        (bad_alt, Proposal.unpack)):
        with pytest.raises(ProtocolError):
            unpack(buf, N_CTX, N_VOCAB)


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([7], [8]) == 0
    rng = np.random.default_rng(0)
    for _ in range(200):
        a = rng.integers(0, 3, rng.integers(0, 40)).tolist()
        b = a[:rng.integers(0, len(a) + 1)] + rng.integers(0, 3, rng.integers(0, 5)).tolist()
        expect = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        assert common_prefix(a, b) == expect


# ---------------------------------------------------------------- steering, re-rooting, stale drafts
def test_drafts_ahead_to_the_horizon_and_no_further():
    d = CountingDrafter()
    client, service = pair(d)
    client.begin([10, 11, 12])
    client.steer([10, 11, 12], horizon=7, p_min=0.5, n_chunk=2)
    pump(service)
    assert d.prefilled == [[10, 11, 12]]
    assert [len(c) for c, _ in d.calls] == [3, 5]                # chunks of 2 up to the horizon
    assert service.ctx == [10, 11, 12, 13, 14, 15, 16]          # 2 + 2 tokens, then the horizon
    client.poll()
    nodes, unconfident = client.ready([10, 11, 12], 0.5, 3)
    assert [n.token for n in nodes] == [13, 14, 15] and not unconfident
    nodes, _ = client.ready([10, 11, 12, 13, 14], 0.5, 3)       # continuing the head's own chain
    assert [n.token for n in nodes] == [15, 16]


def take_ctrl(service: DraftService) -> None:
    """The service reads the messages waiting for it, without drafting."""
    while (buf := service.end.recv(block=False)) is not None:
        service.apply(DraftCtrl.unpack(buf, N_CTX, N_VOCAB))


def test_reroot_keeps_the_shared_prefix_and_drops_stale_drafts():
    d = CountingDrafter()
    client, service = pair(d)
    client.begin([1, 2, 3])
    client.steer([1, 2, 3], horizon=8, p_min=0.5, n_chunk=1)
    take_ctrl(service)
    service.step()                                              # drafts 4
    client.steer([1, 2, 3, 4, 9], horizon=8, p_min=0.5, n_chunk=1)  # verification: position 4 is 9
    assert client.epoch == 1                                    # the drafter is only behind: no re-root yet
    service.step()                                              # drafts 5: now it went another way
    client.steer([1, 2, 3, 4, 9], horizon=8, p_min=0.5, n_chunk=1)
    assert client.epoch == 2 and client.seq == [1, 2, 3, 4, 9]  # re-rooted after the shared 1, 2, 3, 4
    service.step()                                              # drafts 6 before it reads the re-root: stale
    pump(service)
    assert service.ctx[:5] == [1, 2, 3, 4, 9] and service.stats.n_reroots == 1
    assert d.calls[3][0] == [1, 2, 3, 4, 9]                    # the drafter drafts on the corrected chain
    client.poll()
    assert client.n_stale == 1
    nodes, _ = client.ready([1, 2, 3, 4, 9], 0.5, 4)
    assert [n.token for n in nodes] == [10, 11, 12]
    nodes, _ = client.ready([1, 2, 3, 4, 5], 0.5, 4)           # a chain the drafter no longer follows
    assert nodes == []


def test_a_stopped_drafter_is_re_rooted_on_the_tokens_it_lacks():
    d = CountingDrafter(conf=lambda pos: 0.9 if pos != 4 else 0.1)
    client, service = pair(d)
    client.begin([1, 2, 3])
    client.steer([1, 2, 3], horizon=8, p_min=0.5, n_chunk=1)
    pump(service)                                               # 4, then nothing above 0.5 at position 4
    client.poll()
    assert service.stopped and client.stopped_at == 4
    client.steer([1, 2, 3, 4, 7], horizon=8, p_min=0.5, n_chunk=1)  # the target's token at 4: re-root on it
    assert client.epoch == 2
    pump(service)
    client.poll()
    assert client.ready([1, 2, 3, 4, 7], 0.5, 2)[0][0].token == 8


def test_unconfident_chain_stops_until_the_cutoff_falls():
    d = CountingDrafter(conf=lambda pos: 0.9 if pos < 5 else 0.4)
    client, service = pair(d)
    client.begin([1, 2, 3])
    client.steer([1, 2, 3], horizon=10, p_min=0.5, n_chunk=1)
    pump(service)
    assert service.ctx == [1, 2, 3, 4, 5] and service.stopped  # position 5 is below 0.5: the drafter waits
    n_calls = len(d.calls)
    client.poll()
    assert client.ready([1, 2, 3, 4, 5], 0.5, 1) == ([], True)  # the head sees it is unconfident (p_decay)
    client.steer([1, 2, 3, 4, 5], horizon=10, p_min=0.5, n_chunk=1)
    pump(service)
    assert len(d.calls) == n_calls                              # nothing changed: no new call
    client.steer([1, 2, 3, 4, 5], horizon=10, p_min=0.3, n_chunk=1)  # the cutoff decays below 0.4
    pump(service)
    client.poll()
    nodes, _ = client.ready([1, 2, 3, 4, 5], 0.3, 2)
    assert [n.token for n in nodes] == [6, 7] and nodes[0].prob == pytest.approx(0.4)


def test_synchronous_draft_through_a_thread():
    td = ThreadDrafter(lambda p, t, c: CountingDrafter(conf=lambda pos: 0.9 if pos < 8 else 0.2), N_CTX, N_VOCAB)
    try:
        td.client.begin([1, 2, 3])
        nodes = td.client.draft([1, 2, 3], Cutoffs(0.5, 1.0, 3, 1))
        assert [n.token for n in nodes] == [4, 5, 6]
        nodes = td.client.draft([1, 2, 3, 4, 5, 6, 7], Cutoffs(0.5, 1.0, 4, 1))  # stops at position 8
        assert [n.token for n in nodes] == [8]
    finally:
        td.close()


def test_thread_drafter_error_reaches_the_head():
    class Broken(CountingDrafter):
        def draft(self, context, cut):
            raise RuntimeError("draft model failed")
    td = ThreadDrafter(lambda p, t, c: Broken(), N_CTX, N_VOCAB)
    try:
        td.client.begin([1, 2])
        with pytest.raises(RuntimeError, match="draft model failed"):
            td.client.draft([1, 2], Cutoffs(0.5, 1.0, 2, 1))
    finally:
        td.close()


# ---------------------------------------------------------------- the real Head with a drafter beside it
STEP_WAIT_S = 30  # the last stage steps anyway after this long (a drafter that never idles fails, not hangs)


def drafter_idle(td: ThreadDrafter):
    """A check that holds once the drafter thread has applied every message the head sent and drafted what it
    was asked (messages are counted as they are sent and once applied)."""
    n = {"sent": 0, "applied": 0, "stepping": 0}
    send, apply, step = td.client.end.send, td.service.apply, td.service.step

    def counted_send(buf):
        n["sent"] += 1
        send(buf)

    def counted_apply(msg):
        apply(msg)
        n["applied"] += 1

    def counted_step():
        n["stepping"] += 1
        step()
        n["stepping"] -= 1
    td.client.end.send, td.service.apply, td.service.step = counted_send, counted_apply, counted_step
    return lambda: (td.error is not None or n["sent"] == n["applied"] and not n["stepping"]
                    and not td.service.has_work())


def thread_head(mode: str, error_rate: float, seed: int, monkeypatch, runner_ups: bool = False, **kw):
    """The real Head with a ToyDrafter in a thread beside the fake pipeline, whose last stage takes its next step
    only once the drafter is idle: a pipeline slower than its drafter (what drafting ahead is for), whatever the
    machine's load does to the drafter's thread, which runs at the normal priority here."""
    monkeypatch.setattr(draftahead, "DRAFT_NICE", 0)
    td = ThreadDrafter(lambda p, t, c: ToyDrafter(error_rate, seed, runner_ups=runner_ups), N_CTX, 10**6)
    idle = drafter_idle(td)
    since = {"t": time.monotonic()}

    def due(pipe) -> bool:
        if idle() or time.monotonic() - since["t"] > STEP_WAIT_S:
            since["t"] = time.monotonic()
            return True
        return False
    monkeypatch.setattr(FakePipeline, "_due", due)
    try:
        return run_head(mode, drafter=td.client, error_rate=error_rate, seed=seed, step_s=0.001, **kw), td
    finally:
        td.close()


@pytest.mark.parametrize("error_rate, seed, poll_every", [(0.0, 0, 3), (0.2, 1, 3), (0.5, 2, 2), (1.0, 3, 4)])
def test_pipeinfer_with_the_draft_beside_equals_target(monkeypatch, error_rate, seed, poll_every):
    r, td = thread_head("pipeinfer", error_rate, seed, monkeypatch, poll_every=poll_every, n_max=2)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    assert r.stats.n_draft_accepted <= r.stats.n_drafted
    if error_rate == 0.0:
        assert r.stats.n_cancelled == 0 and r.stats.n_draft_accepted > 20
    if 0 < error_rate < 1:
        assert r.stats.n_cancelled > 0 and td.service.stats.n_reroots > 0


@pytest.mark.parametrize("error_rate, seed", [(0.3, 1), (0.6, 2)])
def test_trees_with_the_draft_beside_equal_target(monkeypatch, error_rate, seed):
    """--max-branches 2 with the drafter in a thread: its runner-ups travel in the proposals and go beside the
    chain as siblings (no stage costs here: every runner-up over -ps joins, within the batch cap); a sibling
    taken at a miss keeps the output the target's."""
    r, _ = thread_head("pipeinfer", error_rate, seed, monkeypatch, runner_ups=True, n_max=3, max_branches=2)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    assert r.stats.n_siblings > 0 and r.stats.n_siblings_right > 0


def test_speculative_with_the_draft_beside_equals_target(monkeypatch):
    r, _ = thread_head("speculative", 0.3, 5, monkeypatch)
    assert r.out == r.expected
    assert r.pipe.max_in_flight == 1 and r.stats.n_spec_runs > 0
    assert_clean_end(r)



@pytest.mark.parametrize("quiet_first", [True, False])
def test_quiet_first_token_launches_nothing_speculative_before_it(monkeypatch, quiet_first):
    from pipeinfer.decide.head import Head
    events: list[tuple[str, int]] = []
    launch, emit = FakePipeline.launch, Head._emit
    monkeypatch.setattr(FakePipeline, "launch", lambda self, rid, batch, spec, parent=-1, rules=None:
                        (events.append(("spec" if spec else "run", rid)), launch(self, rid, batch, spec, parent,
                                                                              rules))[1])
    monkeypatch.setattr(Head, "_emit", lambda self, tokens, logprobs=None: (events.append(("emit", len(tokens))),
                                                                         emit(self, tokens, logprobs))[1])
    r, _ = thread_head("pipeinfer", 0.2, 6, monkeypatch, n_max=2, quiet_first=quiet_first)
    assert r.out == r.expected and r.streamed == r.out
    assert_clean_end(r)
    emits = [i for i, e in enumerate(events) if e[0] == "emit"]
    window = [e[0] for e in events[emits[0] + 1:emits[1]]]  # from the prompt's token to the next emission
    if quiet_first:
        assert window == ["run"], events[:12]  # only the next token's non-speculative run
    assert r.stats.n_spec_runs > 0             # speculation resumes after it


def test_close_drains_the_link_up_to_the_drafters_closed_answer():
    import threading
    from pipeinfer.core.protocol import CLOSED_EPOCH
    client, service = pair(CountingDrafter())
    client.remote = True  # as over MPI: proposals left unreceived at MPI_Finalize make UCX warn on stdout
    client.begin([1, 2, 3])
    client.steer([1, 2, 3], 40, 0.5, 2)
    server = threading.Thread(target=service.serve)
    server.start()
    client.close()  # returns only once the service answered END, every proposal before it taken
    server.join(timeout=10)
    assert not server.is_alive() and service.stats.n_calls > 0
    assert client.end.recv(block=False) is None  # nothing left on the link
    closed = Proposal(CLOSED_EPOCH, 0, [], []).pack()
    assert Proposal.unpack(closed, N_CTX, N_VOCAB).epoch == CLOSED_EPOCH
    bad = closed.copy()
    bad[0] = -2
    with pytest.raises(ProtocolError):
        Proposal.unpack(bad, N_CTX, N_VOCAB)
