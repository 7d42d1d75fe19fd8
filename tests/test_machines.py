"""`pipeinfer plan --machines`: hosts you describe, a target read from its header, the host model, what fits."""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parent))

from pipeinfer.cli.main import main as cli  # noqa: E402
from pipeinfer.twin.machines import (  # noqa: E402
    GIB,
    NAMED_TARGETS,
    SERIAL_SHARE,
    Calibration,
    Machine,
    described_profile,
    first_start_s,
    fit,
    machines_from_hosts,
    place,
    serial_share_from,
    target_from_gguf,
)
from pipeinfer.twin.plan import REFERENCE_PROFILE  # noqa: E402
from pipeinfer.wire.launcher import hostfile_text, parse_hostfile_text  # noqa: E402

PROF = json.loads(REFERENCE_PROFILE.read_text())
CAL = Calibration.of(PROF)
T70 = NAMED_TARGETS["70b-q4_k_m"]
FOUR = """\
xeon-a    # pipeinfer: cores=16 mem=64 mem_bw=60 disk=500 link=1000
xeon-b    # pipeinfer: cores=16 mem=64 mem_bw=60 disk=500 link=1000
desktop   # pipeinfer: cores=8 mem=32 mem_bw=40 disk=200 link=1000
laptop    # pipeinfer: role=draft cores=4 mem=8 mem_bw=20 disk=50 link=1000
"""


def test_describing_keys_parse_and_round_trip():
    hosts = parse_hostfile_text(FOUR)
    assert hosts[0].cores == 16 and hosts[0].mem_bw == 60 and hosts[0].disk == 500 and hosts[0].link == 1000
    assert parse_hostfile_text(hostfile_text(hosts)) == hosts
    with pytest.raises(ValueError, match="cores must be positive"):
        parse_hostfile_text("h # pipeinfer: cores=0")


def test_a_host_without_cores_is_named():
    with pytest.raises(ValueError, match="missing on b"):
        machines_from_hosts(parse_hostfile_text("a # pipeinfer: cores=2\nb # pipeinfer: mem=8"))


def test_the_target_from_its_header(tmp_path):
    from synth_arch import make_arch_gguf
    path = tmp_path / "moe.gguf"
    make_arch_gguf(path, "qwen3moe")
    t = target_from_gguf(path)
    assert t.arch == "qwen3moe" and t.n_layer >= 2
    assert 0 < t.active_layer_bytes < t.layer_bytes  # a token reads its experts, not all of them
    weights = t.n_layer * t.layer_bytes + t.embd_bytes + t.out_bytes
    assert weights <= t.file_bytes and weights > 0.5 * t.file_bytes


def test_serial_share_recovers_amdahl():
    s = 0.2
    assert serial_share_from([100 * (s + (1 - s) / t) for t in (1, 2, 3, 4)]) == pytest.approx(s, abs=1e-9)
    assert serial_share_from([100.0]) == SERIAL_SHARE


def test_the_calibration_gives_back_the_profiled_host():
    """A host described like the profiled one, with the profiled split, decodes one row as the profile measured."""
    here = Machine("vm", slots=2, cores=2, threads=1)
    model = PROF["model"]
    for r in PROF["ranks"]:
        n = r["layers"][1] - r["layers"][0]
        active = n * model["active_layer_bytes"] + (model["out_bytes"] if r["last"] else 0)
        assert CAL.stage_ms(here, 1, active, 1) == pytest.approx(r["ms_by_batch"][0], rel=0.15)
    total = sum(r["ms_by_batch"][0] for r in PROF["ranks"])
    predicted = sum(CAL.stage_ms(here, 1, (r["layers"][1] - r["layers"][0]) * model["active_layer_bytes"]
                                 + (model["out_bytes"] if r["last"] else 0), 1) for r in PROF["ranks"])
    assert predicted == pytest.approx(total, rel=1e-6)


def test_the_roofline():
    fast_memory = Machine("a", cores=1, mem_bw_gbps=1000)
    slow_memory = Machine("b", cores=64, mem_bw_gbps=10)
    nbytes = 500e6
    # compute-bound: twice the core speed, half the time; memory-bound: threads do not help
    assert CAL.stage_ms(replace(fast_memory, speed=2.0), 1, nbytes, 1) - CAL.fixed_ms == pytest.approx(
        (CAL.stage_ms(fast_memory, 1, nbytes, 1) - CAL.fixed_ms) / 2, rel=0.01)
    assert CAL.stage_ms(slow_memory, 32, nbytes, 1) - CAL.fixed_ms == pytest.approx(
        nbytes / (10e6 * CAL.bw_efficiency), rel=0.01)
    assert CAL.stage_ms(slow_memory, 64, nbytes, 1) == CAL.stage_ms(slow_memory, 32, nbytes, 1)
    # a memory-bound host streams the weights once for a few rows
    assert CAL.stage_ms(slow_memory, 64, nbytes, 2) == CAL.stage_ms(slow_memory, 64, nbytes, 1)


def test_the_split_follows_speed_and_ram():
    ms = machines_from_hosts(parse_hostfile_text(FOUR))
    ranks = place(ms, T70, CAL)
    stages = [r for r in ranks if not r.draft]
    counts = [r.layers[1] - r.layers[0] for r in stages]
    assert sum(counts) == T70.n_layer and stages[-1].last and ranks[-1].draft
    assert counts[0] == counts[1] > counts[2]  # the desktop streams at 40 GB/s, the Xeons at 60
    small = [replace(m, mem_gib=12.0) if m.name == "xeon-a" else m for m in ms]
    capped = [r.layers[1] - r.layers[0] for r in place(small, T70, CAL) if not r.draft]
    assert capped[0] < counts[0] and sum(capped) == T70.n_layer


def test_fit_names_what_is_short():
    ms = machines_from_hosts(parse_hostfile_text(FOUR))
    ranks = place(ms, T70, CAL)
    fits = fit(ranks, T70)
    assert not [p for f in fits for p in f.problems]
    first = fits[0]
    assert first.disk_gib * GIB > T70.file_bytes  # the GGUF and its own stage file
    short = [replace(m, disk_gib=40.0) if m.name == "xeon-a" else replace(m, mem_gib=8.0) if m.name == "desktop"
             else m for m in ms]
    problems = [p for f in fit(place(short, T70, CAL), T70) for p in f.problems]
    assert any(p.startswith("xeon-a: needs") and "disk" in p for p in problems)
    tiny = [replace(m, mem_gib=4.0) for m in ms]
    assert any("of the 80 layers" in p for f in fit(place(tiny, T70, CAL), T70) for p in f.problems)


def test_first_start_is_the_other_stages_over_the_head_link():
    ms = machines_from_hosts(parse_hostfile_text(FOUR))
    ranks = place(ms, T70, CAL)
    sent = sum(T70.stage_bytes(r.layers[1] - r.layers[0], r.first, r.last) for r in ranks[1:] if not r.draft)
    assert first_start_s(ranks, T70) == pytest.approx(sent / 125e6)


def test_the_described_profile_runs_in_the_twin():
    from pipeinfer.decide.genconfig import GenConfig
    from pipeinfer.twin.cluster import cluster_from_profile
    from pipeinfer.twin.sim import simulate
    ms = machines_from_hosts(parse_hostfile_text(FOUR))
    prof, _ = described_profile(ms, T70, CAL, PROF, draft_bytes=T70.draft_bytes)
    assert [r["rank"] for r in prof["ranks"]] == [0, 1, 2] and prof["links"][0]["bandwidth_bps"] == 1e9
    res = simulate(cluster_from_profile(prof), replace(GenConfig(stop_at_eos=False), mode="iterative", n_predict=16))
    per_token = 1 / res.stats.gen_tokens_per_s
    assert per_token == pytest.approx(sum(r["ms_by_batch"][0] for r in prof["ranks"]) / 1e3, rel=0.1)


def _plan(tmp_path, text, *args):
    hosts = tmp_path / "hosts"
    hosts.write_text(text)
    return CliRunner().invoke(cli, ["plan", "--machines", str(hosts), *args])


def test_plan_prints_fit_split_speeds_and_the_command(tmp_path):
    r = _plan(tmp_path, FOUR, "--model-size", "70b-q4_k_m", "-n", "32")
    assert r.exit_code == 0, r.output
    assert "fits: every host" in r.output and "first start:" in r.output and "time to first token" in r.output
    recommended = [ln for ln in r.output.splitlines() if ln.startswith("pipeinfer launch --hostfile")]
    assert len(recommended) == 1 and "--draft-at rank" in recommended[0] and "--layer-split" in recommended[0]
    assert "the fastest command's hosts:" in r.output and "verdict:" in r.output
    clients = _plan(tmp_path, FOUR, "--model-size", "70b-q4_k_m", "-n", "16", "--clients", "4")
    assert clients.exit_code == 0, clients.output
    assert "recommended: --parallel" in clients.output
    run = next(ln for ln in clients.output.splitlines() if ln.startswith("run: "))
    assert "-- serve" in run and "--parallel" in run and "--batch-rows" in run and " -c " in run


def test_plan_refuses_in_one_line(tmp_path):
    small = FOUR.replace("mem=64", "mem=8").replace("mem=32", "mem=16")
    r = _plan(tmp_path, small, "--model-size", "70b-q4_k_m")
    assert r.exit_code == 1 and "does not fit" in r.output
    r = _plan(tmp_path, "a # pipeinfer: mem=8\n", "--model-size", "8b-q4_k_m")
    assert r.exit_code == 1 and "cores" in r.output and "Traceback" not in r.output
    r = _plan(tmp_path, FOUR)
    assert r.exit_code == 2 and "-m MODEL.gguf or --model-size" in r.output


def test_plan_clients_sizes_the_context_and_says_when_the_load_does_not_fit(tmp_path):
    """20 clients of 2000 + 256 tokens: -c for all of them at once (not serve's 4096), or, where the hosts' RAM does
    not hold that, the most it holds, in one line."""
    from pipeinfer.twin.plan import load_cells, parallel_within
    assert load_cells(20, 2000, 256, 3) >= 20 * 2256 and load_cells(20, 2000, 256, 3) % 256 == 0
    assert parallel_within(load_cells(7, 2000, 256, 3), 2000, 256, 3) == 7
    home = "d # pipeinfer: cores=16 mem=64 mem_bw=60\nl # pipeinfer: cores=8 mem=32 mem_bw=40\n"
    r = _plan(tmp_path, home, "--model-size", "70b-q4_k_m", "-n", "16", "--n-prompt", "200", "--clients", "20")
    assert r.exit_code == 0, r.output
    run = next(ln for ln in r.output.splitlines() if ln.startswith("run: "))
    assert f" -c {load_cells(20, 200, 16, 2)} " in run and "does not fit" not in r.output
    small = home.replace("mem=64", "mem=30").replace("mem=32", "mem=24")
    r = _plan(tmp_path, small, "--model-size", "70b-q4_k_m", "-n", "256", "--n-prompt", "2000", "--clients", "20")
    assert r.exit_code == 0, r.output
    short = [ln for ln in r.output.splitlines() if ln.startswith("the load does not fit")]
    assert len(short) == 1 and "need -c" in short[0]


def test_moe_rows_read_other_experts():
    """A mixture of experts' second row reads other experts: a memory-bound decode of 2 rows costs more than one,
    a dense model's the same; the named MoE sizes hold their published active shares."""
    moe, dense = NAMED_TARGETS["qwen3-235b-a22b-q4_k_m"], T70
    assert moe.read_layer_bytes(1) == moe.active_layer_bytes
    assert moe.active_layer_bytes < moe.read_layer_bytes(2) < moe.read_layer_bytes(64) <= moe.layer_bytes
    assert moe.read_layer_bytes(10_000) == pytest.approx(moe.layer_bytes)
    assert dense.read_layer_bytes(4) == dense.active_layer_bytes
    slow = Machine("m", cores=64, mem_bw_gbps=20)
    n = moe.n_layer
    one = CAL.stage_ms(slow, 64, moe.active_stage_bytes(n, True), 1, moe.read_stage_bytes(n, True, 1))
    two = CAL.stage_ms(slow, 64, moe.active_stage_bytes(n, True), 2, moe.read_stage_bytes(n, True, 2))
    assert two > 1.5 * one
    for name, active_b in (("qwen3-30b-a3b-q4_k_m", 3.3), ("glm-4.5-air-q4_k_m", 12), ("gpt-oss-120b-mxfp4", 5.1),
                           ("deepseek-v3-q4_k_m", 37)):
        t = NAMED_TARGETS[name]
        total = t.n_layer * t.layer_bytes + t.embd_bytes + t.out_bytes
        active = t.n_layer * t.active_layer_bytes + t.out_bytes
        assert active / total == pytest.approx(active_b / {"qwen3-30b-a3b-q4_k_m": 30.5, "glm-4.5-air-q4_k_m": 106,
                                                           "gpt-oss-120b-mxfp4": 117, "deepseek-v3-q4_k_m": 671}[name],
                                               rel=0.35), name


def test_size_names_are_one_lookup():
    from pipeinfer.twin.machines import named_draft_hint, named_target
    assert named_target("70B-Q4_K_M.gguf") is NAMED_TARGETS["70b-q4_k_m"] and named_target("nope") is None
    assert "Llama-3.2-1B" in named_draft_hint("llama-3.3-70b-q4_k_m") and named_draft_hint("x.gguf") is None
    r = CliRunner().invoke(cli, ["models", "drafts", "70b-q4_k_m"])
    assert r.exit_code == 0 and "Llama-3.2-1B" in r.output


def test_plan_prices_each_depth_of_drafts_of_drafts(tmp_path):
    """--draft A --draft B --draft ngram: a line per depth, and the command drafts at the chosen one. With CPU row
    costs and levels agreeing 70% of the time the first level alone is the cheapest; at 99% a level below pays."""
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"\0" * 4_000_000)
    b.write_bytes(b"\0" * 400_000)
    r = _plan(tmp_path, FOUR, "--model-size", "70b-q4_k_m", "-n", "16", "--draft", str(a), "--draft", str(b),
              "--draft", "ngram")
    assert r.exit_code == 0, r.output
    depths = [ln for ln in r.output.splitlines() if ln.startswith("drafts of drafts:")]
    assert len(depths) == 3 and depths[0].endswith("(chosen)"), depths
    line = next(ln for ln in r.output.splitlines() if ln.startswith("pipeinfer launch --hostfile"))
    assert f"--draft {a}" in line and str(b) not in line
    r = _plan(tmp_path, FOUR, "--model-size", "70b-q4_k_m", "-n", "16", "--draft", str(a), "--draft", str(b),
              "--level-agreement", "0.99")
    depths = [ln for ln in r.output.splitlines() if ln.startswith("drafts of drafts:")]
    assert r.exit_code == 0 and depths[1].endswith("(chosen)") and "verifying 7" in depths[1], r.output
    line = next(ln for ln in r.output.splitlines() if ln.startswith("pipeinfer launch --hostfile"))
    assert f"--draft {a} --draft {b}" in line
