"""The cluster's live page (frontend/page.py, state.py, static/): fast tests over the scripted session the API tests
use (the page and its files, /state's shape, the cluster as a HeadSession and as a supervisor know it); then a
real headless Chromium (selenium) on a real 2-rank server under mpiexec, and on a supervised one that loses a rank.
The browser tests save screenshots into results/page/."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from api_fakes import ScriptedSession, simple_template
from pipeinfer.core.config import Config, DraftOptions, ServingOptions
from pipeinfer.core.topology import LayerRange
from pipeinfer.serving import link
from pipeinfer.feeders.generator import Generator
from pipeinfer.frontend.app import ServeConfig, create_app
from pipeinfer.frontend.page import STATIC
from pipeinfer.frontend.state import ClusterState

SHOTS = Path(__file__).resolve().parent.parent / "results" / "page"


def make_app(webui: bool = True):
    session = ScriptedSession()
    gen = Generator(session, max_queue=16, log=lambda _msg: None)
    gen.start()
    return gen, create_app(ServeConfig("fake", 512, 4, 64, webui=webui), gen, session.tok, simple_template)


@pytest.fixture(scope="module")
def client():
    gen, app = make_app()
    with TestClient(app) as c:
        yield c
    gen.stop()


# ------------------------------------------------------------------------------------ the page and its files
def _without_comments(text: str, name: str) -> str:
    if name.endswith(".html"):
        return re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"(^|\s)//.*$", "", text, flags=re.M) if name.endswith(".js") else text


def test_the_page_and_its_files_are_served_and_need_no_network(client):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/static/page.js" in r.text and "/static/page.css" in r.text
    for name, kind in (("page.js", "text/javascript"), ("page.css", "text/css")):
        got = client.get(f"/static/{name}")
        assert got.status_code == 200 and got.headers["content-type"].startswith(kind), name
    assert client.get("/static/nothing.js").status_code == 404
    files = sorted(p.name for p in STATIC.iterdir())
    assert files == ["index.html", "page.css", "page.js"]
    for p in STATIC.iterdir():
        code = _without_comments(p.read_text(), p.name)
        assert not re.search(r"https?://|//cdn|@import", code), (p.name, re.findall(r".{30}https?://.{30}", code))


def test_no_webui_leaves_the_page_out_but_not_the_state():
    gen, app = make_app(webui=False)
    try:
        with TestClient(app) as c:
            assert c.get("/").status_code == 404 and c.get("/static/page.js").status_code == 404
            assert c.get("/state").status_code == 200
    finally:
        gen.stop()


def test_serve_has_the_no_webui_option():
    from click.testing import CliRunner

    from pipeinfer.cli.main import main
    out = CliRunner().invoke(main, ["serve", "--help"]).output
    assert "--no-webui" in out


# ------------------------------------------------------------------------------------ /state
def test_state_shape_and_its_numbers_move(client):
    s = client.get("/state").json()
    assert {"model", "status", "phase", "cluster", "load", "activity", "events", "busy", "busy_note", "lost",
            "reforms", "n_ranks", "parallel"} <= set(s)
    assert s["model"] == "fake" and s["status"] == "ok" and s["busy"] is None and "llama_decode" in s["busy_note"]
    assert {"queued", "generating", "runs_in_flight"} <= set(s["load"])
    a = s["activity"]
    assert len(a["history"]) == 60 and {"tokens_per_s", "tokens_total", "requests_done", "acceptance"} <= set(a)
    before = a["tokens_total"]
    r = client.post("/v1/chat/completions", json={"model": "fake", "messages": [{"role": "user", "content": "say:hello"}]})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "hello"
    a = client.get("/state").json()["activity"]
    assert a["tokens_total"] == before + 5 and a["requests_done"] >= 1 and a["tokens_per_s"] > 0
    assert a["recent"][0]["tokens"] == 5 and a["recent"][0]["finish"] == "stop"
    assert sum(a["history"]) + 5 >= 5  # this second's tokens join the history once it is over


def _head_session(draft_at: str = "head", n_world: int = 2):
    hosts = [("alpha", 100), ("beta", 200), ("beta", 300)][:n_world]
    config = Config("t.gguf", draft=DraftOptions(model="/m/draft.gguf", drafter="model", at=draft_at),
                    serving=ServingOptions(parallel=2))
    return SimpleNamespace(ranges=[LayerRange(0, 3), LayerRange(3, 8)], threads=[4, 2], config=config,
                           live=SimpleNamespace(hosts=hosts, mem_available=[8 * 2**30, 4 * 2**30, 4 * 2**30][:n_world]))


def _generator(**kw):
    return SimpleNamespace(submit=lambda job: None, load=lambda: {"queued": 1, "generating": 2, "runs_in_flight": 3},
                           parallel=2, fatal=None, **kw)


def test_the_cluster_of_a_head_session():
    s = ClusterState(ServeConfig("m", 512, 4, 64), _generator(session=_head_session())).snapshot()
    c = s["cluster"]
    assert [h["name"] for h in c["hosts"]] == ["alpha", "beta"] and c["n_layers"] == 8 and not c["supervised"]
    r0, r1 = (h["ranks"][0] for h in c["hosts"])
    assert (r0["rank"], r0["layers"], r0["threads"], r0["pid"], r0["head"]) == (0, [0, 3], 4, 100, True)
    assert (r1["rank"], r1["layers"], r1["threads"], r1["draft"]) == (1, [3, 8], 2, None)
    assert r0["draft"]["kind"] == "draft.gguf" and r0["draft"]["at"] == "head" and r0["draft"]["threads"] == 4
    assert c["hosts"][0]["mem_gib"] == 8.0 and s["load"]["runs_in_flight"] == 3 and s["n_ranks"] == 2
    # --draft-at rank: the world's last rank drafts, with no layers of the target
    c = ClusterState(ServeConfig("m", 512, 4, 64), _generator(session=_head_session("rank", 3))).cluster()
    draft = c["hosts"][1]["ranks"][1]
    assert (draft["rank"], draft["role"], draft["layers"], draft["draft"]["where"]) == (2, "draft", None,
                                                                                         "its own rank (2)")


def _stage(rank: int, host: str, busy: float, idle: float, n: int = 1) -> dict:
    """One stage's counters as HeadSession.stages() gives them."""
    return {"rank": rank, "host": host, "n_reports": n, "n_decoded": n, "n_tokens": 3 * n, "n_cancelled_before": 1,
            "n_cancelled_mid": 0, "n_kv_txns": 0, "t_busy_s": busy, "t_idle_s": idle, "bytes_sent": 1000 * n}


def test_busy_share_from_two_readings():
    from pipeinfer.frontend.state import busy_share
    old, new = _stage(1, "h", 2.0, 6.0), _stage(1, "h", 5.0, 7.0)
    assert busy_share(old, new) == 0.75          # 3 s busy, 1 s idle in between
    assert busy_share(None, new) == round(5 / 12, 3)  # no earlier reading: since the stage started
    assert busy_share(new, new) is None          # nothing moved
    assert busy_share(_stage(1, "h", 0.0, 1.0), _stage(1, "h", 0.0, 4.0)) == 0.0
    assert busy_share(new, _stage(1, "h", 1.0, 1.0)) == 0.5  # counters below the old ones (a new job): since it began


def test_busy_window_takes_the_reading_about_a_window_old():
    from pipeinfer.frontend.state import BusyWindow
    w = BusyWindow(window_s=5.0)
    assert w.shares([_stage(1, "h", 1.0, 1.0)], now=100.0) == {(1, "h"): 0.5}   # the first: since the start
    assert w.shares([_stage(1, "h", 2.0, 2.0)], now=102.0)[(1, "h")] == 0.5      # 2 s so far: against the first
    w.shares([_stage(1, "h", 5.0, 2.0)], now=106.0)
    w.shares([_stage(1, "h", 5.0, 3.0)], now=108.0)
    # at 112 the newest reading at least 5 s old is 106's: 0 busy, 3 idle since then
    assert w.shares([_stage(1, "h", 5.0, 5.0)], now=112.0)[(1, "h")] == 0.0
    assert w.shares([_stage(1, "h", 9.0, 5.0)], now=114.0)[(1, "h")] == pytest.approx(4 / 6, abs=1e-3)  # since 108


def test_each_rank_shows_its_stage_and_busy_share():
    session = _head_session()
    stages = [_stage(0, "alpha", 1.0, 3.0), _stage(1, "beta", 3.0, 1.0, n=4)]
    gen = _generator(session=session)
    gen.load = lambda: {"queued": 0, "generating": 1, "runs_in_flight": 2, "stages": stages}
    state = ClusterState(ServeConfig("m", 512, 4, 64), gen)
    s = state.snapshot()
    assert s["busy"] == [{"rank": 0, "host": "alpha", "busy_share": 0.25}, {"rank": 1, "host": "beta", "busy_share": 0.75}]
    r1 = s["cluster"]["hosts"][1]["ranks"][0]
    assert r1["stage"]["n_decoded"] == 4 and r1["stage"]["bytes_sent"] == 4000 and r1["stage"]["busy_share"] == 0.75
    stages[1] = _stage(1, "beta", 3.0, 5.0, n=5)  # a second reading: idle since the first
    s = state.snapshot()
    assert s["busy"][1]["busy_share"] == 0.0 and s["busy"][0]["busy_share"] is None  # rank 0: nothing moved


def _supervisor(tmp_path, phase="serving"):
    from pipeinfer.supervisor.supervisor import Supervisor
    sup = Supervisor(["localhost", "localhost"], Config("t.gguf", mode="iterative"), tok=None,
                     log=lambda _msg: None)
    sup.health.phase = phase
    sup.health.ready = link.Ready(2, 2, [("box", 11), ("box", 12)], [2**31, 2**31], [(0, 2), (2, 4)], [1, 1])
    return sup


def test_the_cluster_of_a_supervisor_and_its_lost_rank(tmp_path):
    sup = _supervisor(tmp_path)
    state = ClusterState(ServeConfig("m", 512, 4, 64), sup)
    state.install()
    s = state.snapshot()
    c = s["cluster"]
    assert c["supervised"] and [r["layers"] for r in c["hosts"][0]["ranks"]] == [[0, 2], [2, 4]]
    assert s["status"] == "ok" and c["draft"] is None  # iterative: no draft
    # rank 1 is lost: its slot greyed under its host with the reason, the event logged, the status degraded
    sup.lifecycle.slots.drop(1, "box")
    sup.lifecycle.n_reforms, sup.health.phase = 1, "re-forming"
    sup.log("[serve] re-forming the pipeline without rank 1 (host box) on 1 slot(s): rank 1 (host box) is gone")
    sup.log("[serve] something else")
    sup.health.ready = link.Ready(1, 1, [("box", 13)], [2**31], [(0, 4)], [2])
    s = state.snapshot()
    assert s["status"] == "degraded" and s["reforms"] == 1 and s["lost"] == ["rank 1 (host box)"]
    assert [e["line"] for e in s["events"]] == ["re-forming the pipeline without rank 1 (host box) on 1 slot(s): "
                                                "rank 1 (host box) is gone"]
    lost = [r for h in s["cluster"]["hosts"] for r in h["ranks"] if r["lost"]]
    assert len(lost) == 1 and lost[0]["reason"] == "rank 1 (host box)" and s["cluster"]["stale"]
    assert s["n_ranks"] == 1


def test_a_supervisors_stage_counters_never_go_back_across_a_re_form(tmp_path):
    """Rank 0's Stages of each job add up by (rank, host): a re-formed job's stages count from zero; a late Stages
    of the job before is ignored; a stage the new job lacks keeps its last total."""
    sup = _supervisor(tmp_path)
    first, second = object(), object()
    sup.health.stage_totals.new_job(first)
    sup.health.stage_totals.take(first, [_stage(0, "box", 1.0, 2.0, n=10), _stage(1, "box", 4.0, 1.0, n=10)])
    assert [(s["rank"], s["n_decoded"], s["t_busy_s"]) for s in sup.load()["stages"]] == [(0, 10, 1.0), (1, 10, 4.0)]
    sup.health.stage_totals.new_job(second)  # rank 1 (host box) lost: the job re-forms on rank 0 alone
    sup.health.stage_totals.take(first, [_stage(0, "box", 9.0, 9.0, n=99)])  # the old job's reader, late: ignored
    sup.health.stage_totals.take(second, [_stage(0, "box", 0.5, 0.5, n=2)])
    totals = {s["rank"]: s for s in sup.load()["stages"]}
    assert (totals[0]["n_decoded"], totals[0]["t_busy_s"]) == (12, 1.5) and totals[1]["n_decoded"] == 10
    assert "n_reports" not in totals[0]
    sup.health.ready = link.Ready(1, 1, [("box", 13)], [2**31], [(0, 4)], [2])
    s = ClusterState(ServeConfig("m", 512, 4, 64), sup).snapshot()
    assert s["busy"] == [{"rank": 0, "host": "box", "busy_share": 0.375}]  # the current job's one stage: 1.5 busy, 2.5 idle


def test_ready_carries_the_layers_and_threads_and_older_lines_still_decode():
    ready = link.Ready(2, 1, [("a", 1), ("b", 2)], [5, 6], [(0, 2), (2, 4)], [3, 1])
    assert link.decode(link.encode(ready)) == ready
    old = '{"op":"ready","ranks":1,"parallel":1,"ranks_at":[["a",1]],"mem_available":[5]}'
    assert link.decode(old).layers is None


# ------------------------------------------------------------------------------------ a real browser
def _browser():
    """A headless Chromium through selenium (Debian's chromium + chromium-driver); skipped when missing unless
    PIPEINFER_REQUIRE_REAL is set."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        chromium = None
    if not (chromium and driver):
        why = "needs chromium, chromedriver (apt install chromium chromium-driver) and selenium (pip)"
        if os.environ.get("PIPEINFER_REQUIRE_REAL"):
            pytest.fail(why)
        pytest.skip(why)
    from helpers import headless_chromium
    return headless_chromium("--window-size=1500,1050", "--no-first-run", "--disable-extensions")


@pytest.fixture
def browser():
    b = _browser()
    yield b
    b.quit()


def shot(browser, name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    path = SHOTS / f"{name}.png"
    browser.get_screenshot_as_file(str(path))
    return path


def _wait(what, check, timeout: float = 60, srv=None):
    from helpers import wait_until
    return wait_until(check, timeout, lambda: f"{what}" + (f"\n{srv.text()[-2000:]}" if srv else ""), every=0.2)


def _text(browser, css: str) -> str:
    """The first match's text, read in one script: the page redraws every second, so an element found by one
    WebDriver call may be gone by the next (StaleElementReferenceException)."""
    return browser.execute_script("const e = document.querySelector(arguments[0]); return e ? e.innerText : ''", css)


def _ranks_shown(browser) -> dict[str, str]:
    """Each shown rank's text by its data-rank, read in one script (see _text)."""
    pairs = browser.execute_script("return Array.from(document.querySelectorAll('.rank[data-rank]'))"
                                   ".map(e => [e.dataset.rank, e.innerText])")
    return dict(pairs)


def _chat(browser, text: str, max_tokens: int) -> str:
    """The page's chat: one message sent, its streamed answer once it is whole."""
    from selenium.webdriver.common.by import By
    box = browser.find_element(By.ID, "chat-max")
    box.clear()
    box.send_keys(str(max_tokens))
    browser.execute_script("arguments[0].value = arguments[1]", browser.find_element(By.ID, "chat-input"), text)
    browser.find_element(By.ID, "chat-send").click()
    done = _wait("the chat's answer", lambda: browser.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done]"), 120)
    assert done[-1].get_attribute("data-done") == "ok", done[-1].text
    return browser.execute_script("return document.querySelector('.msg.assistant:last-child .text').textContent")


@pytest.mark.mpi
@pytest.mark.browser
def test_the_page_of_a_real_2_rank_server(models, tmp_path, browser):
    from helpers import PROMPT_TEXT, Server
    # the draft in series on the head: a request alone drafts whenever the draft is confident, however busy the
    # machine (a draft in a thread beside may have nothing ready before each result on a loaded one: then no
    # request drafts and the page rightly shows no acceptance)
    srv = Server(["-m", str(models["q8"]), "--mode", "pipeinfer", "--draft", str(models["draft60"]), "-n", "64",
                  "--draft-at", "head", "--alias", "synthetic", "-c", "2048", "--parallel", "2"], 2,
                 tmp_path / "server.log")
    try:
        state = json.loads(srv.request("GET", "/state")[2])
        layers = {str(r["rank"]): r["layers"] for h in state["cluster"]["hosts"] for r in h["ranks"]}
        assert set(layers) == {"0", "1"} and layers["0"][0] == 0 and layers["0"][1] == layers["1"][0], layers
        browser.get(f"http://127.0.0.1:{srv.port}/")
        shown = _wait("both ranks on the page", lambda: (lambda s: s if len(s) == 2 else None)(_ranks_shown(browser)))
        for rank, (start, end) in layers.items():
            assert f"layers {start}–{end - 1}" in shown[rank] and "thread" in shown[rank], shown
        shot(browser, "real-2-ranks-idle")
        assert "draft" in shown["0"] and "head" in shown["0"].lower() and "draft" not in shown["1"]

        # the chat streams the answer the API gives for the same request
        body = {"model": "synthetic", "messages": [{"role": "user", "content": PROMPT_TEXT}], "max_tokens": 24,
                "temperature": 0}
        want = json.loads(srv.request("POST", "/v1/chat/completions", body)[2])["choices"][0]["message"]["content"]
        assert _chat(browser, PROMPT_TEXT, 24) == want
        shot(browser, "real-2-ranks-chat")

        # the numbers move while a few requests run
        done0 = int(_text(browser, "#done"))
        seen = {"tps": 0.0, "generating": 0}

        def ask(k: int) -> None:
            srv.request("POST", "/v1/completions", {"model": "synthetic", "prompt": PROMPT_TEXT, "max_tokens": 400,
                                                    "seed": k, "temperature": 1.0})
        workers = [threading.Thread(target=ask, args=(k,)) for k in range(4)]
        for w in workers:
            w.start()
        def rank1_busy() -> bool:  # its stage has reported work (the page shows it at its next poll, a second on)
            st = json.loads(srv.request("GET", "/state")[2])
            r1 = next(r for h in st["cluster"]["hosts"] for r in h["ranks"] if r["rank"] == 1)
            return bool((r1.get("stage") or {}).get("busy_share"))
        deadline, shot_taken = time.monotonic() + 120, False
        while time.monotonic() < deadline and (any(w.is_alive() for w in workers) or not shot_taken):
            seen["tps"] = max(seen["tps"], float(_text(browser, "#tps") or 0))
            seen["generating"] = max(seen["generating"], int(_text(browser, "#generating") or 0))
            if not shot_taken and seen["tps"] > 0 and seen["generating"] > 0 and rank1_busy():
                time.sleep(1.5)
                shot(browser, "real-2-ranks-busy")
                shot_taken = True
            time.sleep(0.3)
        assert shot_taken, "rank 1 never showed a busy share while the requests ran"

        for w in workers:
            w.join()
        _wait("the finished requests counted", lambda: int(_text(browser, "#done")) >= done0 + 4)
        assert seen["tps"] > 0 and seen["generating"] >= 1, seen
        assert _text(browser, "#acceptance").endswith("%"), _text(browser, "#acceptance")
        shot(browser, "real-2-ranks-after")
    finally:
        code = srv.stop()
    assert code == 0, srv.text()[-3000:]


@pytest.mark.mpi
@pytest.mark.browser
def test_the_page_shows_a_lost_rank_and_the_re_form(models, tmp_path, browser):
    from helpers import PROMPT_TEXT, Server
    srv = Server(["--np", "2", "-m", str(models["q8"]), "--mode", "iterative", "-c", "2048", "--stall-timeout", "3",
                  "--alias", "synthetic"], None, tmp_path / "sup.log", timeout=180)
    try:
        browser.get(f"http://127.0.0.1:{srv.port}/")
        shown = _wait("both ranks on the page", lambda: (lambda s: s if len(s) == 2 else None)(_ranks_shown(browser)))
        assert all("layers" in t and "n/a" not in t.split("\n")[1] for t in shown.values()), shown
        shot(browser, "supervised-2-ranks")
        os.kill(srv.job_ranks()[1], signal.SIGKILL)
        _wait("the lost rank on the page", lambda: _text(browser, ".rank.lost"), 120, srv)
        _wait("the re-form in the page's log", lambda: "re-form" in _text(browser, "#events"), 120, srv)
        _wait("the re-formed job on one rank", lambda: len(_ranks_shown(browser)) == 1
              and json.loads(srv.request("GET", "/state")[2])["phase"] == "serving", 120, srv)
        assert "rank 1" in _text(browser, ".rank.lost") and "DEGRADED" in _text(browser, "#status")
        assert "layers 0–3" in _ranks_shown(browser)["0"]
        shot(browser, "supervised-lost-rank")
        assert srv.stream({"model": "synthetic", "prompt": PROMPT_TEXT, "max_tokens": 8})  # and it serves on
    finally:
        code = srv.stop()
    assert code == 0, srv.text()[-3000:]
