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
    assert "pipeinfer launch --hostfile" in r.output.splitlines()[-1] and "--draft-at rank" in r.output
    clients = _plan(tmp_path, FOUR, "--model-size", "70b-q4_k_m", "-n", "16", "--clients", "4")
    assert clients.exit_code == 0, clients.output
    assert "recommended: --parallel" in clients.output
    run = clients.output.splitlines()[-1]
    assert "-- serve" in run and "--parallel" in run and "--batch-rows" in run


def test_plan_refuses_in_one_line(tmp_path):
    small = FOUR.replace("mem=64", "mem=8").replace("mem=32", "mem=16")
    r = _plan(tmp_path, small, "--model-size", "70b-q4_k_m")
    assert r.exit_code == 1 and "does not fit" in r.output
    r = _plan(tmp_path, "a # pipeinfer: mem=8\n", "--model-size", "8b-q4_k_m")
    assert r.exit_code == 1 and "cores" in r.output and "Traceback" not in r.output
    r = _plan(tmp_path, FOUR)
    assert r.exit_code == 2 and "-m MODEL.gguf or --model-size" in r.output
