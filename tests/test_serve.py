"""`pipeinfer serve`: a real server on 2 ranks under mpiexec on a loopback port, driven with the `openai`
package (streaming and not) and with raw HTTP for the error cases."""
import json
import re
import threading

import pytest

from helpers import (PROMPT_TEXT as PROMPT, Server, cli, hang_up, open_stream, real_model, sse_events, wait_until)
from pipeinfer.decide.batching import default_parallel

pytestmark = pytest.mark.mpi
# no max_tokens: a request gets the room the context leaves (serve -n is larger), and holds every cell
FILL = "100000"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    srv = Server(["-m", str(models["q8"]), "--mode", "pipeinfer", "--draft", str(models["draft60"]), "-n", FILL,
                  "--alias", "synthetic", "--alias", "gpt-4o-mini", "-c", "2048", "--results", str(log.with_name("served.csv"))], 2, log)
    yield srv
    assert srv.stop() == 0, srv.text()[-3000:]
    assert "Traceback" not in srv.text()


def client(srv):
    from openai import OpenAI
    return OpenAI(base_url=srv.base_url, api_key="none", max_retries=0, timeout=120)


def serve_lines(srv) -> list[str]:
    return [ln for ln in srv.text().splitlines() if "[serve] " in ln]


def new_serve_line(srv, before: int, wanted: str, timeout: float = 30) -> str:
    """The first `[serve]` log line after the first `before` ones that holds `wanted`, once it is there (rank 0's
    lines reach the log through mpiexec, after the answer)."""
    return wait_until(lambda: next((ln for ln in serve_lines(srv)[before:] if wanted in ln), None), timeout,
                      lambda: f"no [serve] line with {wanted!r}:\n{srv.text()[-2000:]}")


def hold_every_cell(srv):
    """A streamed request that takes every cell of the context (it generates until hang_up): whatever comes after it
    waits in the queue. (connection, response)."""
    conn, r = open_stream(srv.port, {"model": srv_model_id(srv), "prompt": PROMPT})
    assert r.status == 200, r.read()
    next(sse_events(r))  # generating
    return conn, r


def srv_model_id(srv) -> str:
    return json.loads(srv.request("GET", "/v1/models")[2])["data"][0]["id"]


def generate_text(models, n: int, *extra, prompt: str = PROMPT) -> str:
    """What `pipeinfer generate` prints for the prompt (the reference a served answer must equal)."""
    p = cli(["generate", "-m", str(models["q8"]), "-p", prompt, "--no-chat", "-n", str(n), "-q", "--drafter", "ngram",
             *extra], n=2)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.endswith("\n")
    return p.stdout[:-1]


def test_models_and_health(server):
    assert [m.id for m in client(server).models.list().data] == ["synthetic", "gpt-4o-mini"]
    status, _, body = server.request("GET", "/health")
    assert status == 200 and json.loads(body)["status"] == "ok"


def test_completion_equals_generate(server, models):
    c = client(server)
    r = c.completions.create(model="synthetic", prompt=PROMPT, max_tokens=20)
    assert r.choices[0].text == generate_text(models, 20)
    assert r.usage.completion_tokens == 20 and r.usage.total_tokens == r.usage.prompt_tokens + 20
    assert r.choices[0].finish_reason == "length"
    # streamed, the same text in pieces
    pieces = [ch.choices[0].text for ch in c.completions.create(model="synthetic", prompt=PROMPT, max_tokens=20,
                                                                 stream=True)]
    assert "".join(pieces) == r.choices[0].text and len([p for p in pieces if p]) > 1


def test_every_request_is_logged_and_gets_a_results_row(server):
    before = len(serve_lines(server))
    client(server).completions.create(model="synthetic", prompt=PROMPT, max_tokens=5)
    line = new_serve_line(server, before, "prompt + 5 tokens")
    assert "tokens/s" in line and "ttft" in line, line
    queued, prompt, ttft = (float(re.search(rf"{word} ([0-9.]+) s", line)[1]) for word in ("queued", "prompt", "ttft"))
    assert ttft + 0.01 >= queued + prompt, line  # from the arrival: the wait and the prompt count (2 decimals each)
    from pipeinfer.core.results import read_results
    rows = read_results(server.log_path.with_name("served.csv"))
    assert rows[-1]["n_generated"] == 5 and rows[-1]["prompt_name"] == "serve:length" and rows[-1]["mode"] == "pipeinfer"


def test_sampled_completion_follows_the_seed(server, models):
    c = client(server)
    for seed in (7, 8):
        got = c.completions.create(model="synthetic", prompt=PROMPT, max_tokens=16, temperature=2.0, top_p=0.95,
                                   seed=seed).choices[0].text
        assert got == generate_text(models, 16, "--temp", "2.0", "--top-p", "0.95", "--seed", str(seed))


def test_chat_streaming_and_not(server):
    c = client(server)
    msgs = [{"role": "user", "content": PROMPT}]
    whole = c.chat.completions.create(model="synthetic", messages=msgs, max_tokens=12)
    assert whole.choices[0].message.role == "assistant" and whole.usage.completion_tokens == 12
    chunks = list(c.chat.completions.create(model="synthetic", messages=msgs, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12


def test_stop_string_cuts_the_answer(server):
    c = client(server)
    full = c.completions.create(model="synthetic", prompt=PROMPT, max_tokens=20).choices[0].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    r = c.completions.create(model="synthetic", prompt=PROMPT, max_tokens=20, stop=[stop])
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="synthetic", prompt=PROMPT, max_tokens=20, stop=stop, stream=True))
    assert streamed == r.choices[0].text


def test_a_list_of_prompts_is_one_choice_each_equal_to_its_single_request(server):
    c = client(server)
    prompts = [PROMPT, "lo ki ba", "ki ki"]
    singles = [c.completions.create(model="synthetic", prompt=p, max_tokens=14).choices[0].text for p in prompts]
    r = c.completions.create(model="synthetic", prompt=prompts, max_tokens=14)
    assert [ch.index for ch in r.choices] == [0, 1, 2]
    assert [ch.text for ch in r.choices] == singles and len(set(singles)) == 3  # never joined
    assert r.usage.completion_tokens == 42


@pytest.fixture(scope="module")
def flat_server(tmp_path_factory):
    """A server of a synthetic model whose next-token distribution is flat enough that sampled answers differ by
    seed (the shared models put almost all the mass on one token, even at temperature 2)."""
    from synth import make_llama_gguf
    tmp_path = tmp_path_factory.mktemp("flat")
    model = make_llama_gguf(tmp_path / "flat.gguf", n_layer=4, qtype="q8_0", logit_scale=1.0)
    srv = Server(["-m", str(model), "--mode", "pipeinfer", "--drafter", "ngram", "-c", "1024", "--alias", "flat"], 2,
                 tmp_path / "server.log")
    yield srv
    assert srv.stop() == 0, srv.text()[-3000:]


def test_n_choices_each_equal_the_single_request_with_its_seed(flat_server):
    """n: 3 sampled: choice j is the single request with seed + j, whole and streamed (interleaved by index)."""
    c = client(flat_server)
    ask = {"model": "flat", "prompt": PROMPT, "max_tokens": 16, "temperature": 1.5, "top_p": 0.95}
    singles = [c.completions.create(seed=4 + j, **ask).choices[0].text for j in range(3)]
    assert len(set(singles)) == 3
    r = c.completions.create(n=3, seed=4, **ask)
    assert [ch.text for ch in r.choices] == singles
    assert r.usage.completion_tokens == 48 and r.usage.prompt_tokens == len(tokenize(flat_server, PROMPT))
    texts = ["", "", ""]
    for chunk in c.completions.create(n=3, seed=4, stream=True, **ask):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == singles


def test_a_sampled_request_without_a_seed_is_a_new_draw_that_its_seed_reproduces(flat_server):
    """The real openai client: four sampled chat requests without a seed each get their own seed (X-Seed) and not
    all the same answer; each seed, sent back, gives its answer again."""
    c = client(flat_server)
    ask = dict(model="flat", messages=[{"role": "user", "content": "Name a random animal."}], max_tokens=12,
               temperature=2.0)
    drawn = []
    for _ in range(4):
        raw = c.chat.completions.with_raw_response.create(**ask)
        drawn.append((int(raw.headers["x-seed"]), raw.parse().choices[0].message.content))
    assert len({seed for seed, _ in drawn}) == 4
    assert len({text for _, text in drawn}) > 1, drawn
    for seed, text in drawn[:2]:
        assert c.chat.completions.create(**ask, seed=seed).choices[0].message.content == text


def tokenize(srv, text: str) -> list[int]:
    status, _, body = srv.request("POST", "/tokenize", {"content": text, "add_special": True})
    assert status == 200, body
    return json.loads(body)["tokens"]


def test_token_id_prompts_equal_their_text(server):
    c = client(server)
    texts = [PROMPT, "lo ki ba"]
    want = [c.completions.create(model="synthetic", prompt=t, max_tokens=12).choices[0].text for t in texts]
    ids = [tokenize(server, t) for t in texts]
    assert c.completions.create(model="synthetic", prompt=ids[0], max_tokens=12).choices[0].text == want[0]
    both = c.completions.create(model="synthetic", prompt=ids, max_tokens=12)
    assert [ch.text for ch in both.choices] == want
    status, _, body = server.request("POST", "/detokenize", {"tokens": ids[1]})
    _, _, pieces = server.request("POST", "/tokenize", {"content": texts[1], "add_special": True, "with_pieces": True})
    joined = b"".join(p.encode() if isinstance(p, str) else bytes(p) for p in
                      (t["piece"] for t in json.loads(pieces)["tokens"]))  # a piece that is part of a character: bytes
    assert status == 200 and json.loads(body)["content"] == joined.decode()
    status, _, body = server.request("POST", "/v1/completions", {"model": "synthetic", "prompt": [ids[0], [10 ** 7]]})
    assert status == 400 and json.loads(body)["error"]["param"] == "prompt.1", body


def test_models_report_the_context_and_unknown_routes_are_openai_errors(server):
    status, _, body = server.request("GET", "/v1/models")
    model = json.loads(body)["data"][0]
    assert model["max_model_len"] == 2048 and model["meta"]["n_ctx"] == 2048 and model["meta"]["n_ctx_train"] > 0
    for method, path, want in (("GET", "/v2/nothing", 404), ("GET", "/v1/completions", 405)):
        status, _, body = server.request(method, path)
        assert status == want and json.loads(body)["error"]["type"] == "invalid_request_error", body


@pytest.mark.parametrize("body, status, code_or_param", [
    (b"{not json", 400, None),
    ({"model": "synthetic"}, 400, "prompt"),
    ({"model": "synthetic", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "synthetic", "prompt": "x", "max_tokens": 100000}, 400, "context_length_exceeded"),
    ({"model": "synthetic", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
])
def test_bad_requests_get_openai_errors(server, body, status, code_or_param):
    got, _, data = server.request("POST", "/v1/completions", **({"raw": body} if isinstance(body, bytes) else {"body": body}))
    assert got == status, data
    err = json.loads(data)["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    if code_or_param:
        assert code_or_param in (err["code"], err["param"]), err


def test_any_model_is_answered_and_an_alias_named(server):
    """--alias names are listed and named in replies; any other name is answered by the model's id."""
    for asked, named in (("gpt-4o-mini", "gpt-4o-mini"), ("gpt-4", "synthetic")):
        got, _, data = server.request("POST", "/v1/completions", {"model": asked, "prompt": "x", "max_tokens": 2})
        assert got == 200 and json.loads(data)["model"] == named, data


def test_bad_chat_requests(server):
    got, _, data = server.request("POST", "/v1/chat/completions", {"model": "synthetic", "messages": []})
    assert got == 400 and json.loads(data)["error"]["param"] == "messages"
    got, _, data = server.request("POST", "/v1/chat/completions",
                                  {"model": "synthetic", "messages": [{"role": "wizard", "content": "x"}]})
    assert got == 400 and "unknown role" in json.loads(data)["error"]["message"]


def test_disconnect_mid_stream_cancels_and_leaves_nothing_behind(server, models):
    before = len(serve_lines(server))
    conn, r = open_stream(server.port, {"model": "synthetic", "prompt": PROMPT, "max_tokens": 1500})
    assert r.status == 200
    next(sse_events(r))  # the first piece
    hang_up(conn)
    line = new_serve_line(server, before, "cancelled")
    assert "1500 tokens" not in line, line  # stopped early
    # the next answer is untouched by the cancelled one (its runs and KV cells are gone)
    assert client(server).completions.create(model="synthetic", prompt=PROMPT, max_tokens=20).choices[0].text == \
        generate_text(models, 20)


def test_concurrent_requests_equal_their_single_answers(server, models):
    """Requests at once (the server runs 4 at a time, 2 per stage): different prompts, lengths, seeds, stop
    strings, streaming and not, two clients hanging up mid-stream; each answer equals the one `generate` gives
    alone, and afterwards nothing is generating, queued or holding a partition. They wait behind a request that
    holds every cell until all are queued, so they start together whenever each client's thread got to send."""
    jobs = [(PROMPT, 20, 0.0, 0, None, "plain"), ("lo ki ba", 14, 2.0, 5, None, "stream"),
            ("ki ki", 18, 0.0, 0, "cut", "plain"), ("ba lo", 11, 0.9, 2, None, "stream"),
            (PROMPT, 16, 2.0, 7, None, "plain"), ("ki ba ki lo", 25, 0.0, 0, "cut", "stream"),
            (PROMPT, 300, 0.0, 0, None, "hang-up"), ("lo ki ba", 300, 0.0, 0, None, "hang-up")]
    refs = [generate_text(models, n, "--temp", str(t), "--top-p", "0.95", "--seed", str(sd), prompt=p)
            if how != "hang-up" else None for p, n, t, sd, _, how in jobs]
    stops = [refs[i][len(refs[i]) // 2:len(refs[i]) // 2 + 2] if jobs[i][4] == "cut" else None for i in range(len(jobs))]
    got: dict[int, str] = {}

    def ask(i: int) -> None:
        prompt, n, temp, seed, _, how = jobs[i]
        body = {"model": "synthetic", "prompt": prompt, "max_tokens": n, "temperature": temp, "top_p": 0.95,
                "seed": seed, "stop": stops[i]}
        if how == "hang-up":
            conn, r = open_stream(server.port, body, timeout=120)
            next(sse_events(r))
            hang_up(conn)
            return
        c = client(server)
        if how == "plain":
            got[i] = c.completions.create(**body).choices[0].text
        else:
            got[i] = "".join(ch.choices[0].text for ch in c.completions.create(stream=True, **body))

    holder, _ = hold_every_cell(server)
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(jobs))]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: server.health()["queued"] == len(jobs), 60, lambda: f"not all queued: {server.health()}")
    finally:
        hang_up(holder)
    for t in threads:
        t.join()
    for i, ref in enumerate(refs):
        if ref is not None:
            want = ref[:ref.index(stops[i])] if stops[i] else ref
            assert got[i] == want, (i, jobs[i])

    def idle() -> dict | None:
        health = server.health()
        return health if health["generating"] == 0 and health["runs_in_flight"] == 0 else None
    health = wait_until(idle, 30, lambda: f"still busy: {server.health()}")
    assert health["parallel"] == default_parallel(2, batching=True) and health["queued"] == 0 and health["generating"] == 0, health
    assert health["most_generating"] >= 3, health  # answers were generated at once
    assert health["runs_in_flight"] == 0 and health["partitions_free"] == health["partitions"] > 0, health
    assert f"{default_parallel(2, batching=True)} request(s) at once" in server.text()


def test_full_queue_gets_503_with_retry_after(models, tmp_path):
    """--max-queue 1: a request that holds every cell runs, the next ones wait (in the queue, and at most one
    more where the scheduler waits for cells); once the queue is provably full the next request gets 503 with
    Retry-After, and the ones that waited are answered once the cells are free."""
    srv = Server(["-m", str(models["q8"]), "--mode", "iterative", "--max-queue", "1", "-c", "2048", "-n", FILL], 2,
                 tmp_path / "server.log")
    try:
        holder, _ = hold_every_cell(srv)
        answers: dict[int, tuple[int, str | None]] = {}

        def ask(i: int) -> None:
            status, headers, _ = srv.request("POST", "/v1/completions",
                                             {"model": srv_model(models), "prompt": PROMPT, "max_tokens": 8})
            answers[i] = (status, headers.get("retry-after"))

        waiting: list[threading.Thread] = []
        try:
            for i in range(6):  # one at a time: each waits (queued grows) or is refused
                t = threading.Thread(target=ask, args=(i,))
                t.start()
                wait_until(lambda: i in answers or srv.health()["queued"] == len(waiting) + 1, 60,
                           lambda: f"request {i} neither waits nor is answered: {srv.health()}")
                if i in answers:
                    break
                waiting.append(t)
            assert answers and waiting, (answers, srv.health())
            assert list(answers.values()) == [(503, "1")], answers
            health = srv.health()  # the holder still runs: nothing left the queue while the last request came
            assert health["generating"] == 1 and health["queued"] == len(waiting), health
        finally:
            hang_up(holder)
        for t in waiting:
            t.join()
        assert [answers[i] for i in range(len(waiting))] == [(200, None)] * len(waiting), answers
    finally:
        assert srv.stop() == 0, srv.text()[-3000:]


def srv_model(models) -> str:
    return models["q8"].stem  # the default model id: the file's stem


@pytest.mark.real
@pytest.mark.slow  # the real 1.5B model in a server and in generate: 37 s here, 48 s with a core busy, 145 s with two
def test_real_qwen_chat_equals_generate(tmp_path):
    """The default model and draft (Qwen2.5-Coder-1.5B, Gemma 3 270M through text) served on 2 ranks: a chat
    answer is the text `pipeinfer generate -p` prints for the same prompt."""
    real_model("qwen2.5-coder-1.5b")
    real_model("gemma3-270m")
    question = "Write a Python function that checks whether a number is prime."
    srv = Server(["-t", "1", "-c", "1024"], 2, tmp_path / "server.log", timeout=300)
    try:
        c = client(srv)
        assert [m.id for m in c.models.list().data] == ["qwen2.5-coder-1.5b"]
        r = c.chat.completions.create(model="qwen2.5-coder-1.5b", max_tokens=32,
                                      messages=[{"role": "user", "content": question}])
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="qwen2.5-coder-1.5b", max_tokens=32, stream=True, messages=[{"role": "user", "content": question}]))
    finally:
        assert srv.stop() == 0, srv.text()[-3000:]
    p = cli(["generate", "-p", question, "-n", "32", "-q", "-t", "1", "-c", "1024"], n=2, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert r.choices[0].message.content == p.stdout[:-1] == streamed
    assert r.usage.completion_tokens == 32
    log = srv.text()
    assert log.count("[serve]") == 2 and "acceptance" in log


def test_a_results_row_that_cannot_be_written_is_logged_and_serving_goes_on(models, tmp_path):
    other = tmp_path / "other.csv"
    other.write_text("name,score\nx,1\n")
    srv = Server(["-m", str(models["q8"]), "--mode", "iterative", "-c", "512", "--results", str(other)], 2,
                 tmp_path / "server.log")
    try:
        c = client(srv)
        for _ in range(2):  # the generation thread survives the first failed row
            assert c.completions.create(model=srv_model(models), prompt=PROMPT, max_tokens=4).usage.completion_tokens == 4
        wait_until(lambda: srv.text().count("not a pipeinfer results file") == 2, 30, srv.text)
    finally:
        assert srv.stop() == 0
    assert other.read_text() == "name,score\nx,1\n"
