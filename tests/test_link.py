"""The supervisor <-> rank 0 link (serving/link.py): every message encodes to one JSON line and decodes to itself
on the end that takes it; a line that is not one of them is one clear LinkError; and the two real ends
(Supervisor and attach.run_attached, over a Unix socket) understand each other."""
from __future__ import annotations

import os
import shutil
import socket
import threading
import time

import pytest

from pipeinfer.core.metrics import Stats
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.serving import link
from pipeinfer.serving.job import DoneEvent, ErrorEvent

from link_fakes import WAIT_S, FakeSession, LetterTokenizer, attach_rank0, letter, outcome

SAMPLES = [
    link.Generate(3, [1, 2, 3], [7, 8], 40, SamplingParams(0.7, 40, 0.9, 11), "lo ki", True),
    link.Generate(4, [5], [], 1, SamplingParams()),
    link.Cancel(3),
    link.Stop(),
    link.Ready(2, 4, [("node-a", 1201), ("node-b", 1202)], [2**33, 2**32]),
    link.Tokens(3, [9, 10]),
    link.Done(3, Stats(n_prompt=3, n_generated=2).to_dict()),
    link.JobError(4, "prompt (5000 tokens) + max tokens (40) does not fit the context"),
    link.Stages([{"rank": 0, "host": "node-a", "n_decoded": 7, "t_busy_s": 0.25, "t_idle_s": 1.5}]),
]


def test_every_kind_of_message_has_a_sample():
    assert {type(m) for m in SAMPLES} == set(link.BY_OP.values())
    assert set(link.TO_RANK0) | set(link.TO_SUPERVISOR) == set(link.BY_OP.values())
    assert not set(link.TO_RANK0) & set(link.TO_SUPERVISOR)


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.op)
def test_a_message_is_one_line_and_decodes_to_itself_on_the_end_that_takes_it(msg):
    line = link.encode(msg)
    assert line.endswith("\n") and "\n" not in line[:-1]
    receiver = link.TO_RANK0 if isinstance(msg, link.TO_RANK0) else link.TO_SUPERVISOR
    assert link.decode(line, receiver) == msg
    other = link.TO_SUPERVISOR if receiver is link.TO_RANK0 else link.TO_RANK0
    with pytest.raises(link.LinkError, match=f"^op going the other way: '{msg.op}' \\(this end takes: "):
        link.decode(line, other)


@pytest.mark.parametrize("line, error", [
    ("nope", "not a JSON line: Expecting value"),
    ("[1, 2]", 'not a message (an object with an "op")'),
    ('{"id": 3}', 'not a message (an object with an "op")'),
    ('{"op": "launch", "id": 3}', "unknown op 'launch' (this end takes: ready, tokens, done, error, stages)"),
    ('{"op": "tokens", "id": 3}', "tokens: field 'tokens' missing"),
    ('{"op": "done", "stats": {}}', "done: field 'id' missing"),
    ('{"op": "tokens", "id": 3, "tokens": [1], "rank": 2}', "tokens: unknown field(s) rank"),
    ('{"op": "tokens", "id": "3", "tokens": [1]}', "tokens: field 'id' is not int: '3'"),
    ('{"op": "tokens", "id": true, "tokens": [1]}', "tokens: field 'id' is not int: True"),
    ('{"op": "tokens", "id": 3, "tokens": [1, 2.5]}', "tokens: field 'tokens' is not list[int]: [1, 2.5]"),
    ('{"op": "ready", "ranks": 2, "parallel": 4, "ranks_at": [["a", 1, 2]], "mem_available": [1]}',
     "ready: field 'ranks_at' is not list[tuple[str, int]]"),
])
def test_a_line_that_is_no_message_is_one_clear_error(line, error):
    with pytest.raises(link.LinkError) as e:
        link.decode(line, link.TO_SUPERVISOR)
    assert str(e.value).startswith(error) and "\n" not in str(e.value), str(e.value)


def test_a_generate_without_its_optional_fields_takes_their_defaults():
    line = '{"op":"generate","id":1,"prompt":[2],"replay":[],"n_predict":3,"sampling":{"temp":0,"seed":5}}'
    msg = link.decode(line, link.TO_RANK0)
    assert msg == link.Generate(1, [2], [], 3, SamplingParams(0.0, 0, 1.0, 5), None, False)
    assert type(msg.sampling.temp) is float


def test_sampling_goes_by_its_fields_names():
    line = link.encode(link.Generate(1, [2], [], 3, SamplingParams(0.7, 40, 0.9, 11)))
    assert '"sampling":{"temp":0.7,"top_k":40,"top_p":0.9,"seed":11}' in line


@pytest.mark.parametrize("sampling, error", [
    ("[0.7, 40, 0.9, 11]", "generate: field 'sampling' is not SamplingParams: [0.7, 40, 0.9, 11]"),
    ('{"temp": 0.7, "k": 40}', "generate: field 'sampling' is not SamplingParams: {'temp': 0.7, 'k': 40}"),
    ('{"temp": "hot"}', "generate: field 'sampling' is not SamplingParams: {'temp': 'hot'}"),
    ('{"seed": true}', "generate: field 'sampling' is not SamplingParams: {'seed': True}"),
])
def test_a_sampling_that_is_not_one_is_one_clear_error(sampling, error):
    line = f'{{"op":"generate","id":1,"prompt":[2],"replay":[],"n_predict":3,"sampling":{sampling}}}'
    with pytest.raises(link.LinkError) as e:
        link.decode(line, link.TO_RANK0)
    assert str(e.value) == error


def test_a_closed_link_refuses_to_send_and_its_reader_sees_the_end():
    a, b = socket.socketpair()
    near, far = link.Link(a, link.TO_RANK0), link.Link(b, link.TO_SUPERVISOR)
    near.send(link.Tokens(1, [2]))  # (a rank 0 message on a socket pair: the direction is the receiver's)
    assert far.receive() == link.Tokens(1, [2])
    got = []
    reader = threading.Thread(target=lambda: got.append(near.receive()))
    reader.start()
    near.close()
    reader.join(WAIT_S)
    assert not reader.is_alive() and got == [None]
    with pytest.raises(link.LinkClosed):
        near.send(link.Stop())
    assert far.receive() is None
    far.close()


# ------------------------------------------------------------------------------------ the two real ends
def test_the_supervisor_and_rank0_understand_each_other(tmp_path):
    """A Supervisor attached to run_attached (a fake session) over a Unix socket: Ready, a job with every field,
    a resumed job (its replay), a refused one, a cancelled one, and Stop."""
    from pipeinfer.serving.answer import Answer
    from pipeinfer.supervisor.resume import StdoutJob
    from pipeinfer.supervisor.inflight import Record
    from pipeinfer.supervisor.supervisor import Supervisor
    session = FakeSession()
    listener, conn, rank0 = attach_rank0(tmp_path, session)
    fatal: list[str] = []
    sup = Supervisor(["localhost", "localhost"], [], LetterTokenizer(), log=lambda _msg: None,
                     on_fatal=fatal.append)
    try:
        sup._attach(*sup.lifecycle.greet(conn))
        assert sup.parallel == 3 and sup.lifecycle.pids == [os.getpid()] and sup.lifecycle.host_mem["localhost"] > 0
        full = StdoutJob([1, 2], 12, SamplingParams(0.5, 40, 0.9, 7), "lo ki", True, as_json=True)
        sup.submit(full)
        assert isinstance(outcome(full), DoneEvent) and full.tokens == [letter(i) for i in range(12)]
        assert (session.requests[0].prompt, session.requests[0].sampling, session.requests[0].prompt_text,
                session.requests[0].chat) == ([1, 2], SamplingParams(0.5, 40, 0.9, 7), "lo ki", True)
        # the stages' counters come over as they change (Stages, at most every second), the pump's waits as idle
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and not [s for s in sup.load()["stages"] if s["n_decoded"] >= 12]:
            time.sleep(0.05)
        stages = sup.load()["stages"]
        assert [(s["rank"], s["host"]) for s in stages] == [(0, "box"), (1, "box")], stages
        assert stages[1]["n_decoded"] >= 12 and stages[1]["bytes_sent"] >= 1200 and "n_reports" not in stages[1]

        resumed = StdoutJob([1], 10, SamplingParams(), "lo", False, as_json=True)
        rec = Record(100, resumed, Answer(resumed, sup.tok), tokens=[letter(0), letter(1), letter(2)])
        with sup._lock:
            sup.requests._records[rec.jid] = rec
            sup._send(rec.generate_message())
        assert isinstance(outcome(resumed), DoneEvent) and rec.tokens == [letter(i) for i in range(10)]
        assert session.requests[-1].replay == rec.tokens[:3] and session.requests[-1].n_predict == 7

        refused = StdoutJob(list(range(20)), 5, SamplingParams(), None, False, as_json=True)
        sup.submit(refused)
        assert outcome(refused) == ErrorEvent("prompt (20 tokens) does not fit")

        threading.Thread(target=sup._watch_cancels, daemon=True).start()
        endless = StdoutJob([1], 10**6, SamplingParams(), None, False, as_json=True)
        sup.submit(endless)
        endless.cancelled.set()
        done = outcome(endless)
        assert isinstance(done, DoneEvent) and done.finish_reason == "cancelled", done
    finally:
        sup.stop()
        listener.close()
        shutil.rmtree(sup.work_dir, ignore_errors=True)
    rank0.join(WAIT_S)
    assert not rank0.is_alive() and not fatal
