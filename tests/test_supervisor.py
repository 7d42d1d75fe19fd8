"""A supervised server (`pipeinfer serve --np N`, run without mpiexec: supervisor.py) survives a lost rank: the
job re-forms on the slots left and every request in flight resumes, its answer unchanged."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from helpers import (JOBS, PROMPT_TEXT, Server, cli, job_references, kill_tagged, new_tag, rank_pids,
                     reference, stream_jobs, tagged_env, universal_newlines, wait_until)

pytestmark = pytest.mark.mpi


def supervised(args: list[str], log_path) -> Server:
    """A supervised server (`serve --np/--hostfile`, no mpiexec) on a free loopback port."""
    return Server(args, None, log_path, timeout=180)


def start_supervised(cmd: list[str]) -> tuple[subprocess.Popen, str]:
    """A supervised `generate` (no mpiexec) in a session of its own; its tag (rank_pids(tag, attached=True))."""
    tag = new_tag()
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=tagged_env(tag)), tag


def stop_supervised(p: subprocess.Popen, tag: str) -> None:
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
    kill_tagged(tag)


def test_per_rank_options_follow_the_slots_left():
    from pipeinfer.core.config import Config, StageOptions
    first = Config("x.gguf", stage=StageOptions(layer_split="0.2,0.3,0.5", threads="4,2,1", threads_batch="3",
                                                n_ctx=2048))
    assert first.for_places([0, 2], 3) == Config("x.gguf", stage=StageOptions(
        layer_split="0.2,0.5", threads="4,1", threads_batch="3", n_ctx=2048))
    assert first.for_places([0, 1, 2], 3) == first  # every slot back (--rejoin): the first job's configuration
    auto = Config("x.gguf").with_options(layer_split="auto")
    assert auto.for_places([1], 2).stage.layer_split == "auto"  # re-measured anyway


def test_a_resumed_answer_is_timed_across_its_jobs_and_says_when_nothing_was_drafted():
    """The last job's Stats of a resumed request: its own clock and tokens only (its t_first_s unset when it sent
    one token, so a ttft of minus the clock); resumed_stats times the whole answer as the supervisor saw it."""
    from pipeinfer.core.metrics import Stats
    from pipeinfer.serving.answer import drafts_said
    from pipeinfer.supervisor.inflight import Record, resumed_stats
    last_job = Stats(n_generated=1, n_drafted=4, n_draft_accepted=3, t_start_s=5000.0, t_prompt_done_s=5000.5,
                     t_first_s=0.0, t_last_s=5001.0)
    rec = Record(1, None, None, tokens=list(range(12)), n_resumes=1, t_sent=10.0, t_token1=10.5, t_token2=10.7,
                  t_token_last=25.7)
    st = resumed_stats(last_job, rec)
    assert st.n_generated == 12 and st.n_drafted == 4
    assert st.ttft_s == pytest.approx(0.2) and st.gen_tokens_per_s == pytest.approx(11 / 15.2)
    assert st.t_prompt_done_s - st.t_start_s == pytest.approx(0.5)
    one = resumed_stats(last_job, Record(2, None, None, tokens=[7], n_resumes=1, t_sent=3.0, t_token1=4.0,
                                          t_token_last=4.0))
    assert one.ttft_s == 0.0 and one.gen_tokens_per_s == 0.0
    assert drafts_said(st) == "acceptance 75%" and drafts_said(Stats(n_generated=9)) == "nothing drafted"


def test_the_configuration_travels_whole_as_json():
    import json

    from pipeinfer.core.config import Config, DraftOptions, ServingOptions, StageOptions, WireOptions
    from pipeinfer.core.sampling import SamplingParams
    config = Config("x.gguf", mode="speculative", stage=StageOptions(threads="2,1"),
                    serving=ServingOptions(sampling=SamplingParams(0.7, 40, 0.9, -3), parallel=None),
                    draft=DraftOptions(model="d.gguf", drafter="model", at="thread"), wire=WireOptions(poll_s=0.001),
                    set_by_user=frozenset({"threads", "draft"}))
    assert Config.from_json(config.to_json()) == config
    nested = json.loads(config.to_json())   # a section per object, the sampling inside its section
    assert nested["stage"]["threads"] == "2,1" and nested["serving"]["sampling"]["top_k"] == 40
    assert nested["set_by_user"] == ["draft", "threads"]
    with pytest.raises(ValueError, match="unknown fields"):
        Config.from_json('{"model": "x.gguf", "no_such_option": 1}')
    with pytest.raises(ValueError, match=r"unknown fields \['n_ctx', 'stage.no_such_option'\]"):
        Config.from_json('{"model": "x.gguf", "n_ctx": 2048, "stage": {"no_such_option": 1}}')  # a flat one too
    with pytest.raises(ValueError, match="not a pipeinfer configuration"):
        Config.from_json("[1, 2]")
    with pytest.raises(ValueError, match="not a pipeinfer configuration"):
        Config.from_json('{"model": "x.gguf", "stage": 3}')


def test_options_are_set_by_their_command_line_names_into_their_sections():
    """Config.with_options: click's names and values, each into its section's field (core/config.OPTION_FIELDS),
    as the hostfile's settings and start-up set them."""
    from pipeinfer.core.config import Config
    config = Config("x.gguf").with_options(ctx_size=2048, threads="4,2", draft_at="thread", draft_threads=2,
                                           cache_prompt="off", micro_batch="fixed", poll_us=1000, ignore_eos=True)
    assert (config.stage.n_ctx, config.stage.threads, config.stage.cache_prompt) == (2048, "4,2", False)
    assert (config.draft.at, config.draft.threads) == ("thread", 2)
    assert not config.speculation.adaptive_draft and not config.serving.stop_at_eos
    assert config.wire.poll_s == pytest.approx(0.001)
    with pytest.raises(ValueError, match="'n_ctx' is not an option of a pipeline run"):
        config.with_options(n_ctx=1024)   # the field's name is not the option's (-c/--ctx-size)
    with pytest.raises(ValueError, match="on or off"):
        config.with_options(cache_prompt=False)
    with pytest.raises(TypeError, match="Config.draft is a DraftOptions, not str"):
        Config("x.gguf", draft="d.gguf")


def test_a_configuration_that_contradicts_itself_is_refused_however_made():
    from dataclasses import replace

    from pipeinfer.core.config import Config, ServingOptions
    from pipeinfer.core.errors import UserError
    ngram = Config("x.gguf", mode="pipeinfer").with_options(drafter="ngram")
    with pytest.raises(UserError, match="the draft rank has no draft model"):
        ngram.with_options(draft_at="rank")  # a hostfile's draft host, n-grams
    with pytest.raises(UserError, match="the draft rank has no draft model"):
        replace(ngram, draft=replace(ngram.draft, at="rank"))
    with pytest.raises(UserError, match="--mode speculative runs one request at a time"):
        Config("x.gguf", mode="speculative", serving=ServingOptions(parallel=2))


@pytest.fixture(scope="module")
def refs(models):
    return job_references(models["q8"])


@pytest.mark.parametrize("mode, victim, how", [("iterative", 1, signal.SIGKILL), ("pipeinfer", 2, signal.SIGKILL),
                                               ("pipeinfer", 0, signal.SIGKILL), ("iterative", 1, signal.SIGSTOP)])
def test_a_lost_rank_costs_seconds_not_answers(models, refs, tmp_path, mode, victim, how):
    """Three requests stream at once (greedy and seeded); one rank is killed (or frozen) mid-answer: the job
    re-forms on 2 slots, every answer equals the no-failure answer, /health says degraded and names the rank,
    and the server goes on serving."""
    rows = tmp_path / "rows.csv"
    args = ["--np", "3", "-m", str(models["q8"]), "--mode", mode, "-c", "2048", "--stall-timeout", "3",
            "--results", str(rows)]
    if mode == "pipeinfer":
        args += ["--draft", str(models["draft60"]), "--draft-at", "head"]
    jobs = JOBS
    srv = supervised(args, tmp_path / "sup.log")
    try:
        killed = threading.Event()

        def on_piece(k: int) -> None:
            if k == 20 and not killed.is_set():
                killed.set()
                os.kill(srv.job_ranks()[victim], how)

        got = stream_jobs(srv, jobs, on_piece)
        assert killed.is_set()
        for i, ref in enumerate(refs):
            assert universal_newlines(got[i]) == ref, (i, jobs[i], srv.text()[-2000:])
        health = srv.health()
        assert health["status"] == "degraded" and health["ranks"] == 2, health
        assert len(health["lost"]) == 1 and health["lost"][0].startswith(f"rank {victim} (host "), health
        srv.wait_for_log("re-forming the pipeline without rank")
        srv.wait_for_log(r"request\(s\) resumed")
        after = srv.stream({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 30})  # and it goes on serving
        assert after and refs[0].startswith(universal_newlines(after))
        from pipeinfer.core.results import read_results
        results = read_results(rows)
        statuses = sorted(r["status"] for r in results)
        assert statuses[-1] == "ok: resumed 1" and statuses.count("ok") >= 1, statuses
        # a resumed answer is timed across its jobs (the supervisor's clock): never a negative time, and slower than
        # an answer the lost rank did not interrupt (not its last job's tokens over all of its tokens)
        assert all(r["ttft_s"] >= 0 and r["pp_tokens_per_s"] >= 0 for r in results), results
        whole = max(r["gen_tokens_per_s"] for r in results if r["status"] == "ok")
        assert all(0 < r["gen_tokens_per_s"] < whole for r in results if r["status"] != "ok"), results
    finally:
        code = srv.stop()  # (and kills a frozen rank left behind)
    assert code == 0, srv.text()[-3000:]
    assert "Traceback" not in srv.text()


def test_a_request_with_biases_and_logprobs_resumes_after_a_lost_rank(models, tmp_path):
    """A request's decoding (here a logit bias that bans the answer's first token, and log-probabilities) travels
    to the supervised job and again to the re-formed one: the resumed answer is the biased one, equal to the same
    request asked of the re-formed pipeline afterwards."""
    from pipeinfer.engine.tokenizer import Tokenizer
    srv = supervised(["--np", "2", "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048",
                      "--stall-timeout", "3"], tmp_path / "sup.log")
    try:
        status, _, raw = srv.request("POST", "/v1/completions", {"model": "t-q8", "prompt": PROMPT_TEXT,
                                                                "max_tokens": 8, "logprobs": 1})
        assert status == 200, raw
        choice = json.loads(raw)["choices"][0]
        first_piece = choice["logprobs"]["tokens"][0].encode()
        tok = Tokenizer(str(models["q8"]))
        first = next(t for t in range(tok.n_vocab) if tok.piece(t) == first_piece)  # the answer's first token id
        tok.close()
        body = {"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 300, "logprobs": 2,
                "logit_bias": {str(first): -100}}
        killed = threading.Event()

        def on_piece(k: int) -> None:
            if k == 20 and not killed.is_set():
                killed.set()
                os.kill(srv.job_ranks()[1], signal.SIGKILL)
        resumed = srv.stream(body, on_piece)
        assert killed.is_set()
        srv.wait_for_log(r"request\(s\) resumed")
        assert not resumed.startswith(first_piece.decode())  # the bias reached the first job
        assert resumed == srv.stream(body)  # ... and the re-formed one: the same answer, uninterrupted
    finally:
        code = srv.stop()
    assert code == 0, srv.text()[-3000:]


def test_a_rank_lost_during_the_prompt(models, tmp_path):
    """Rank 1 is frozen before a long prompt arrives (so no token can come out) and killed a second later, while
    rank 0 works through the prompt's 8-token chunks: the job re-forms on 2 slots, the prompt is processed again
    and the answer is the no-failure answer."""
    prompt = "lo ki ba " * 60  # about 900 tokens: 113 chunks
    ref = reference(models["q8"], 40, "-b", "8", prompt=prompt)
    srv = supervised(["--np", "3", "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048", "-b", "8"],
                     tmp_path / "sup.log")
    victim = srv.job_ranks()[1]
    try:
        os.kill(victim, signal.SIGSTOP)
        timer = threading.Timer(1.0, os.kill, (victim, signal.SIGKILL))
        timer.start()
        got = srv.stream({"model": "t-q8", "prompt": prompt, "max_tokens": 40})
        assert not timer.is_alive() and universal_newlines(got) == ref, srv.text()[-2000:]
        srv.wait_for_log("re-forming the pipeline without rank 1")
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]


def test_a_rank_lost_with_prompts_in_the_cache(models, tmp_path):
    """Turn 1 leaves its prompt in the cache; turn 2 starts from it and a rank is killed mid-answer: the re-formed
    job starts with an empty cache, the resumed answer is turn 2's cold answer, and asking again (now from the
    re-formed job's cache) gives it again."""
    turn1 = "ba ki lo ki " * 12
    first = reference(models["q8"], 30, "--prompt-chunk", "8", prompt=turn1)
    turn2 = turn1 + first + " lo lo ki ba"
    cold = reference(models["q8"], 400, "--prompt-chunk", "8", "--cache-prompt", "off", prompt=turn2)
    srv = supervised(["--np", "3", "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048", "--prompt-chunk", "8",
                      "--stall-timeout", "3"], tmp_path / "sup.log")
    try:
        assert universal_newlines(srv.stream({"model": "t-q8", "prompt": turn1, "max_tokens": 30})) == first
        killed = threading.Event()

        def on_piece(k: int) -> None:
            if k == 20 and not killed.is_set():
                killed.set()
                os.kill(srv.job_ranks()[1], signal.SIGKILL)
        body = {"model": "t-q8", "prompt": turn2, "max_tokens": 400}
        assert universal_newlines(srv.stream(body, on_piece)) == cold
        assert killed.is_set()
        srv.wait_for_log(r"request\(s\) resumed")
        assert universal_newlines(srv.stream(body)) == cold
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]


@pytest.mark.parametrize("lost", ["slot", "draft host"])
def test_rejoin_takes_a_lost_host_back_while_idle(models, refs, tmp_path, lost):
    """--rejoin: rank 2 killed mid-answer (a target slot of 3, or the draft host's rank, role=draft): the job
    re-forms without it (on 2 slots; or with the draft beside rank 0) and the answer completes; once no request is
    in flight, the host (this machine, so it answers) is taken back and the job re-planned with it; /health is ok
    again and the next answer is the no-failure one."""
    from pipeinfer.supervisor.supervisor import REJOIN_CHECK_S
    if lost == "slot":
        args, n_slots = ["--np", "3", "--mode", "iterative"], 3
    else:
        hosts = tmp_path / "hosts.txt"
        hosts.write_text("localhost:2\n127.0.0.1 # pipeinfer: role=draft\n")
        args, n_slots = ["--hostfile", str(hosts), "--draft", str(models["draft60"])], 2
    srv = supervised(args + ["--rejoin", "-m", str(models["q8"]), "-c", "2048"], tmp_path / "sup.log")
    try:
        killed, degraded = threading.Event(), []

        def on_piece(k: int) -> None:
            if k == 20 and not killed.is_set():
                killed.set()
                os.kill(srv.job_ranks()[2], signal.SIGKILL)
            elif killed.is_set() and not degraded:  # no host is taken back while this answer is in flight
                health = srv.health()
                if health["lost"]:
                    degraded.append(health)
        got = srv.stream({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 600}, on_piece)
        assert killed.is_set() and universal_newlines(got) == refs[0], srv.text()[-2000:]
        assert degraded, "no piece of the answer came after the job re-formed:\n" + srv.text()[-2000:]
        away = degraded[0]["lost"]
        assert len(away) == 1 and ("the draft's rank 2" in away[0]) == (lost == "draft host"), away
        # lost: the draft beside rank 0
        assert degraded[0].get("draft_host", "none") == ("none" if lost == "slot" else None), degraded[0]

        def rejoined() -> dict | None:
            health = srv.health()
            return health if not health["lost"] and health["phase"] == "serving" else None
        health = wait_until(rejoined, REJOIN_CHECK_S + 90, lambda: srv.text()[-2000:], every=0.5)
        assert health["status"] == "ok" and health["ranks"] == n_slots and health["reforms"] == 1, health
        assert health["down_s"] > 0, health  # the re-plan's pause, counted once it ended
        assert health.get("draft_host", "none") == ("none" if lost == "slot" else "127.0.0.1"), health
        assert health["available_gib"]["localhost"] > 0, health  # what the ranks found when the job started
        was = n_slots - (lost == "slot")
        assert re.search(rf"\[serve\] \S+ answer\(s\) again: re-planning the pipeline on {n_slots} slot\(s\) "
                         rf"\(was {was}\)", srv.text()), srv.text()[-2000:]
        after = srv.stream({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 600})
        assert universal_newlines(after) == refs[0], srv.text()[-2000:]
        # every rank back (3 stages; or 2 and the draft's)
        wait_until(lambda: len(srv.job_ranks()) == 3, 30, lambda: f"ranks {srv.job_ranks()}")
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]


def test_no_slot_left_is_one_line_and_a_clean_stop(models, tmp_path):
    srv = supervised(["--np", "1", "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048"], tmp_path / "sup.log")
    try:
        def on_piece(k: int) -> None:
            if k == 5:
                os.kill(srv.job_ranks()[0], signal.SIGKILL)

        def ask() -> None:
            try:  # the answer ends with an error object, or the connection with the server
                srv.stream({"model": "t-q8", "prompt": PROMPT_TEXT, "max_tokens": 2000}, on_piece)
            except (AssertionError, OSError):
                pass
        t = threading.Thread(target=ask)
        t.start()
        t.join(timeout=120)
        srv.proc.wait(timeout=60)
    finally:
        code = srv.stop()
    assert code == 1
    errors = [ln for ln in srv.text().splitlines() if ln.startswith("pipeinfer: error:")]
    assert len(errors) == 1 and "no slot left" in errors[0], srv.text()[-2000:]
    assert "Traceback" not in srv.text()


def test_too_little_memory_on_the_hosts_left_is_one_line(models, tmp_path):
    """Two hosts (localhost and 127.0.0.1, both this machine to MPI) that declare room for 3/4 of the model each:
    they start it split in halves; after one is lost the other cannot hold it all: one line naming the host and
    both sizes, exit 1, the text so far kept on stdout."""
    gib = models["q8"].stat().st_size / 2**30
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(f"localhost # pipeinfer: mem={0.75 * gib:.6f}\n127.0.0.1 # pipeinfer: mem={0.75 * gib:.6f}\n")
    cmd = [sys.executable, "-m", "pipeinfer", "generate", "--hostfile", str(hosts), "-m", str(models["q8"]), "-p",
           PROMPT_TEXT, "--no-chat", "-n", "600", "--mode", "iterative", "-c", "2048", "-q"]
    p, tag = start_supervised(cmd)
    try:
        head = p.stdout.read(40)
        os.kill(rank_pids(tag, attached=True)[1], signal.SIGKILL)
        p.stdout.read()  # drained (the text so far stays on stdout)
        err = p.stderr.read()
        code = p.wait(timeout=120)
    finally:
        stop_supervised(p, tag)
    errors = [ln for ln in err.splitlines() if ln.startswith("pipeinfer: error:")]
    assert code == 1 and len(errors) == 1, err[-2000:]
    assert ("the 1 slot(s) left cannot hold the model: host localhost would hold "
            f"{models['q8'].stat().st_size / 2**30:.2f} GiB of the model on 1 rank(s) and has") in errors[0], errors
    assert len(head) == 40 and "Traceback" not in err
    hosts.write_text(f"localhost # pipeinfer: mem={0.75 * gib:.6f}\n")  # nor does one such host start it at all
    one = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert one.returncode == 1 and one.stdout == "", one.stderr
    assert one.stderr.startswith("pipeinfer: error: the 1 slot(s) cannot hold the model: host localhost would hold"), (
        one.stderr)


@pytest.mark.parametrize("lost", ["slot", "draft host"])
def test_generate_resumes_after_a_lost_rank(models, refs, tmp_path, lost):
    """`generate --np 3` (no mpiexec): rank 1 killed while the text streams, the job re-forms on 2 ranks; or
    `generate --hostfile` with a draft host (role=draft; 127.0.0.1, this machine to MPI) running PipeInfer's draft
    on the job's last rank, that rank killed: the job re-forms on the same 2 target slots with the draft in a
    thread of rank 0. The text on stdout is the uninterrupted run's; the --results row says it was resumed."""
    rows = tmp_path / "rows.csv"
    if lost == "slot":
        args, victim = ["--np", "3", "--mode", "iterative"], 1
        said = r"re-forming the pipeline without rank 1 "
    else:
        hosts = tmp_path / "hosts.txt"
        hosts.write_text("localhost:2\n127.0.0.1 # pipeinfer: role=draft\n")
        args, victim = ["--hostfile", str(hosts), "--draft", str(models["draft60"])], 2
        said = r"re-forming the pipeline without the draft's rank 2 \(host [^)]+\) on 2 slot\(s\) \(the draft beside "
    cmd = [sys.executable, "-m", "pipeinfer", "generate", *args, "-m", str(models["q8"]), "-p", PROMPT_TEXT,
           "--no-chat", "-n", "600", "-c", "2048", "-q", "--results", str(rows)]
    p, tag = start_supervised(cmd)
    try:
        head = p.stdout.read(40)  # the text has begun
        ranks = rank_pids(tag, attached=True)
        assert len(ranks) == 3, ranks
        os.kill(ranks[victim], signal.SIGKILL)
        rest = p.stdout.read()  # (not communicate(): it reads the pipe past what p.stdout has buffered)
        err = p.stderr.read()
        p.wait(timeout=60)
    finally:
        stop_supervised(p, tag)
    assert p.returncode == 0, err[-2000:]
    assert (head + rest).rstrip("\n") == refs[0]
    assert re.search(said, err) and "Traceback" not in err, err[-2000:]
    from pipeinfer.core.results import read_results
    assert [r["status"] for r in read_results(rows)] == ["ok: resumed 1"]


def test_a_rank_lost_while_the_job_starts(models, refs, tmp_path):
    """`generate --np 3`: rank 1 is frozen as soon as it exists and killed 0.5 s later, before the job could
    start (and before any liveness watcher could name it: the launcher reports a pid on this machine's host, which
    holds every slot): the supervisor starts the job again on 2 slots and the text is the uninterrupted run's,
    not resumed (nothing had been generated)."""
    rows = tmp_path / "rows.csv"
    cmd = [sys.executable, "-m", "pipeinfer", "generate", "--np", "3", "-m", str(models["q8"]), "-p", PROMPT_TEXT,
           "--no-chat", "-n", "600", "--mode", "iterative", "-c", "2048", "-q", "--results", str(rows)]
    p, tag = start_supervised(cmd)
    try:
        pid = wait_until(lambda: rank_pids(tag, attached=True).get(1), 60, "rank 1 never started", every=0.01)
        os.kill(pid, signal.SIGSTOP)  # the job cannot start without it
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        out, err = p.communicate(timeout=120)
    finally:
        stop_supervised(p, tag)
    assert p.returncode == 0, err[-2000:]
    assert out.rstrip("\n") == refs[0]
    assert "was lost while the pipeline started: re-forming it on 2 slot(s)" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    from pipeinfer.core.results import read_results
    assert [r["status"] for r in read_results(rows)] == ["ok"]


def test_a_supervised_batch_resumes_every_prompt_in_flight(models, tmp_path):
    """`generate --np 3 --prompts FILE`: a short prompt and three long ones (greedy and seeded) generate at once;
    once the short one's answer is out, rank 1 is killed: the job re-forms on 2 slots, every answer line equals
    the unsupervised batch's, the long ones say they resumed, and each has its --results row."""
    batch = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "ki", "n_predict": 20}] + [{"prompt": p, "n_predict": 1500, "temp": t, "top_p": 0.95,
                                                    "seed": sd} for p, _n, t, sd in JOBS]
    batch.write_text("".join(json.dumps(x) + "\n" for x in lines))
    common = ["generate", "-m", str(models["q8"]), "--prompts", str(batch), "--no-chat", "--mode", "iterative",
              "-c", "4096", "-q"]
    ref = cli(common, n=2, timeout=300)
    assert ref.returncode == 0, ref.stderr[-2000:]
    want = {a["index"]: a["text"] for a in map(json.loads, ref.stdout.splitlines())}
    rows = tmp_path / "rows.csv"
    p, tag = start_supervised([sys.executable, "-m", "pipeinfer", *common, "--np", "3", "--results", str(rows)])
    try:
        first = p.stdout.readline()  # the short answer: the pipeline runs, the long ones are in flight
        os.kill(rank_pids(tag, attached=True)[1], signal.SIGKILL)
        out, err = first + p.stdout.read(), p.stderr.read()
        code = p.wait(timeout=300)
    finally:
        stop_supervised(p, tag)
    assert code == 0 and "re-formed in" in err, err[-3000:]
    got = {a["index"]: a for a in map(json.loads, out.splitlines())}
    assert sorted(got) == [0, 1, 2, 3] and got[0]["resumed"] == 0
    for i, a in got.items():
        assert a["text"] == want[i] and a["resumed"] == (i > 0), (i, a["resumed"], err[-2000:])
    from pipeinfer.core.results import read_results
    assert sorted(r["status"] for r in read_results(rows)) == ["ok"] + ["ok: resumed 1"] * 3


def test_resume_on_failure_needs_a_supervisor(models):
    p = cli(["generate", "-m", str(models["q8"]), "-p", PROMPT_TEXT, "--resume-on-failure"], n=2)
    assert p.returncode != 0 and "need --np N or --hostfile HOSTS" in p.stderr and "Traceback" not in p.stderr
    p = cli(["serve", "-m", str(models["q8"]), "--rejoin"], n=1)
    assert p.returncode == 1 and p.stderr.startswith("pipeinfer: error: --rejoin needs --np N or --hostfile"), p.stderr


def test_the_hub_names_the_rank_lost_first_not_the_ones_mpiexec_ended_after_it():
    from pipeinfer.wire.hub import LOST_TOGETHER_S, first_lost
    # rank 1 stopped (last heard at 9.0), then killed; mpiexec ends ranks 0 and 2 within milliseconds, and a busy
    # hub sees the three connections close in one wake-up
    assert first_lost({0: 10.0, 1: 10.0, 2: 10.0}, {0: 9.9, 1: 9.0, 2: 9.8}) == 1
    # closed apart: the first to close, whatever it said last
    assert first_lost({0: 10.0, 1: 10.0 + 2 * LOST_TOGETHER_S}, {0: 9.9, 1: 5.0}) == 0
    # together, and heard from last at one moment: the lowest rank
    assert first_lost({2: 10.0, 1: 10.0 + LOST_TOGETHER_S / 2}, {1: 9.5, 2: 9.5}) == 1
