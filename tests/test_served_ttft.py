"""A served request's time to first token: one value, from the request's arrival to its first token
(serving.job.time_to_first_token_s), said alike by the request log line, the /metrics histogram and the page's
recent requests; never less than the wait and the prompt the same line reports. Fakes only, no ranks."""
from __future__ import annotations

import re
import threading
from types import SimpleNamespace

from fastapi.testclient import TestClient

from api_fakes import ByteTokenizer, CountingSession, simple_template
from pipeinfer.core.metrics import Stats
from pipeinfer.feeders.generator import Generator
from pipeinfer.frontend.app import ServeConfig, create_app
from pipeinfer.frontend.metrics import ServerMetrics
from pipeinfer.frontend.state import Meter
from pipeinfer.serving.answer import Answer
from pipeinfer.serving.job import time_to_first_token_s

LOGGED = re.compile(r"queued ([0-9.]+) s, prompt ([0-9.]+) s, ttft ([0-9.]+) s")


def histogram_sum_and_count(metrics: ServerMetrics) -> tuple[float, float]:
    samples = {s.name: s.value for s in metrics.ttft.collect()[0].samples}
    return samples["pipeinfer:time_to_first_token_seconds_sum"], samples["pipeinfer:time_to_first_token_seconds_count"]


def test_the_log_the_metric_and_the_page_say_one_ttft_from_the_arrival():
    """Arrived at 10.0, queued 0.25 s, its prompt 1.0 s on the head's clock, its first token at the answer at 11.3:
    1.3 s everywhere, not the paper's 0.2 s from the prompt's end to the next token (Stats.ttft_s)."""
    times = iter([10.0, 11.3])   # the answer made, then its first token
    job = SimpleNamespace(stops=[], push=lambda _event: None, cancelled=threading.Event(), n_predict=3, meter=None,
                          prompt_tokens=[1, 2], request_id="r", t_queued_s=10.0, t_first_token_s=0.0)
    ans = Answer(job, ByteTokenizer(), clock=lambda: next(times))
    ans.on_tokens([])             # nothing yet: no first token
    assert time_to_first_token_s(job) == 0.0
    ans.on_tokens([97])
    ans.on_tokens([98, 99])       # later tokens leave the first one's time alone
    stats = Stats(n_prompt=2, n_generated=3, t_queue_s=0.25, t_start_s=100.0, t_prompt_done_s=101.0,
                  t_first_s=101.2, t_last_s=101.4)
    lines: list[str] = []
    metrics, meter = ServerMetrics(SimpleNamespace()), Meter()
    job.meter = meter

    ans.finish(stats, lines.append, metrics.job_done)
    assert abs(stats.ttft_s - 0.2) < 1e-9   # the paper's (generate, --results), not what the server reports
    (line,) = lines
    queued, prompt, ttft = map(float, LOGGED.search(line).groups())
    assert (queued, prompt, ttft) == (0.25, 1.0, 1.3), line
    assert histogram_sum_and_count(metrics) == (time_to_first_token_s(job), 1.0)
    assert abs(time_to_first_token_s(job) - 1.3) < 1e-9
    assert meter.snapshot()["recent"][0]["ttft_s"] == 1.3


def test_a_request_without_tokens_is_not_observed():
    job = SimpleNamespace(stops=[], push=lambda _event: None, cancelled=threading.Event(), n_predict=3, meter=None,
                          prompt_tokens=[1], request_id="r", t_queued_s=5.0, t_first_token_s=0.0)
    metrics = ServerMetrics(SimpleNamespace())
    Answer(job, ByteTokenizer(), clock=lambda: 5.0).finish(Stats(n_prompt=1), lambda _line: None, metrics.job_done)
    assert histogram_sum_and_count(metrics) == (0.0, 0.0)


def test_a_served_request_logs_what_metrics_and_the_page_report():
    """Through the real app and generation thread: the log line's ttft is the histogram's one observation and the
    page's, and it covers the wait and the prompt the line reports."""
    lines: list[str] = []
    session = CountingSession()
    gen = Generator(session, max_queue=8, log=lines.append)
    gen.start()
    try:
        app = create_app(ServeConfig("fake", 4096, 4, 16), gen, session.tok, simple_template)
        with TestClient(app) as client:
            r = client.post("/v1/chat/completions", json={"model": "fake", "max_tokens": 6,
                                                          "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200, r.text
            page = client.get("/metrics").text
            recent = client.get("/state").json()["activity"]["recent"]
    finally:
        gen.stop()
    (line,) = [ln for ln in lines if ln.startswith("[serve] ")]
    queued, prompt, ttft = map(float, LOGGED.search(line).groups())
    observed = float(re.search(r"^pipeinfer:time_to_first_token_seconds_sum (\S+)$", page, re.M)[1])
    assert re.search(r"^pipeinfer:time_to_first_token_seconds_count 1\.0$", page, re.M), page
    assert abs(observed - ttft) <= 0.0005 and abs(recent[0]["ttft_s"] - ttft) <= 0.0005, (line, observed, recent)
    assert ttft + 0.01 >= queued + prompt, line   # 2 decimals each for the wait and the prompt


def test_an_event_for_a_stopped_server_is_dropped():
    """A generation thread that pushes after the server's event loop closed (a stop with answers in flight) does not
    raise: no one is left to read the event."""
    import asyncio

    from pipeinfer.core.sampling import SamplingParams
    from pipeinfer.serving.job import Job
    loop = asyncio.new_event_loop()
    job = Job([1, 2], 4, SamplingParams(0.0, 0, 1.0, 0), [], None, False, loop)
    loop.close()
    job.push(object())
