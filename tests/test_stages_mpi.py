"""Every stage's live counters on a real server (mpiexec and llama.cpp over a synthetic GGUF): while it serves, with
no shutdown, rank 1's STAGE_STATS reports reach rank 0 and show in /metrics (pipeinfer:stage_*, link_sent_bytes) and
/state (each rank's busy share); the same on a supervised server (`serve --np 2`: rank 0 relays them, link.Stages);
and the server still stops cleanly (every report received before MPI ends)."""
import json

import pytest

from helpers import PROMPT_TEXT, Server, wait_until

pytestmark = pytest.mark.mpi
N_REQUESTS = 3


def stage_samples(srv: Server) -> dict:
    """{(sample name, rank, when): value} of the stage families on /metrics, parsed by prometheus-client."""
    from prometheus_client.parser import text_string_to_metric_families
    text = srv.request("GET", "/metrics")[2].decode()
    return {(s.name, s.labels["rank"], s.labels.get("when")): s.value
            for f in text_string_to_metric_families(text) if f.name.startswith(("pipeinfer:stage_", "pipeinfer:link_"))
            for s in f.samples}


def state_of(srv: Server) -> dict:
    return json.loads(srv.request("GET", "/state")[2])


def check_live_stages(srv: Server) -> None:
    for k in range(N_REQUESTS):
        status, _, body = srv.request("POST", "/v1/completions", {"model": "synthetic", "prompt": PROMPT_TEXT,
                                                                  "max_tokens": 12, "seed": k})
        assert status == 200, body
    # rank 1 reports at most once a second, and rank 0 takes the reports between steps or while it waits
    m = wait_until(lambda: (lambda m: m if m.get(("pipeinfer:stage_decodes_total", "1", None), 0) >= N_REQUESTS
                            else None)(stage_samples(srv)), 30, lambda: f"{stage_samples(srv)}\n{srv.text()[-2000:]}")
    assert m[("pipeinfer:stage_busy_seconds_total", "1", None)] > 0, m
    assert m[("pipeinfer:stage_idle_seconds_total", "1", None)] > 0, m
    assert m[("pipeinfer:stage_batch_tokens_total", "1", None)] >= m[("pipeinfer:stage_decodes_total", "1", None)]
    assert m[("pipeinfer:link_sent_bytes_total", "1", None)] > 0, m
    assert {("pipeinfer:stage_cancelled_total", "1", w) for w in ("before", "mid")} <= set(m), m
    # rank 0's own stage: its decodes timed by rank 0
    assert m[("pipeinfer:stage_decodes_total", "0", None)] >= N_REQUESTS and m[("pipeinfer:stage_busy_seconds_total",
                                                                                  "0", None)] > 0, m
    busy = wait_until(lambda: (lambda s: s["busy"] if s["busy"] and any(b["rank"] == 1 and b["busy_share"] is not None
                                                                         for b in s["busy"]) else None)(state_of(srv)),
                      30, lambda: json.dumps(state_of(srv)["busy"]))
    share = next(b["busy_share"] for b in busy if b["rank"] == 1)
    assert isinstance(share, float) and 0.0 <= share <= 1.0, busy
    ranks = {r["rank"]: r for h in state_of(srv)["cluster"]["hosts"] for r in h["ranks"]}
    assert ranks[1]["stage"]["n_decoded"] >= N_REQUESTS and ranks[1]["stage"]["t_busy_s"] > 0, ranks[1]


def test_a_served_pipelines_stages_show_live(models, tmp_path):
    srv = Server(["-m", str(models["q8"]), "--mode", "pipeinfer", "--draft", str(models["draft60"]), "-n", "64",
                  "--alias", "synthetic", "-c", "1024"], 2, tmp_path / "server.log")
    try:
        check_live_stages(srv)
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]


def test_a_supervised_servers_stages_show_live(models, tmp_path):
    srv = Server(["--np", "2", "-m", str(models["q8"]), "--mode", "iterative", "-n", "64", "--alias", "synthetic",
                  "-c", "1024"], None, tmp_path / "sup.log", timeout=180)
    try:
        check_live_stages(srv)
    finally:
        code = srv.stop()
    assert code == 0 and "Traceback" not in srv.text(), srv.text()[-3000:]
