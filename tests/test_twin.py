"""The digital twin (twin/sim.py, twin/cluster.py): hand-computable schedules, cancellation timing, the commands."""
import json

import numpy as np
import pytest

from pipeinfer.core.config import PROMPT_CHUNK
from pipeinfer.drafters.drafter import Cutoffs
from pipeinfer.decide.genconfig import GenConfig
from pipeinfer.core.protocol import HEADER_LEN, Batch, kv_ops
from pipeinfer.twin.cluster import Cluster, Link, StageCost
from pipeinfer.twin.sim import SimPipeline, VirtualClock, reference_tokens, simulate

from conftest import cli as run_cli
from twin_cases import equal_stages, gen, hand_profile


@pytest.mark.parametrize("n_stages", [2, 3, 8, 32])
def test_iterative_is_stages_times_cost_plus_links(n_stages):
    # one token per pass: N stage decodes and N link hops (the last one back to the head)
    res = simulate(equal_stages(n_stages, ms=10.0, latency_s=1e-3), gen("iterative"))
    assert res.stats.itl_s == pytest.approx(n_stages * (0.010 + 1e-3), rel=1e-9)
    # the 64-token prompt is 2 chunks (63 + 1, GenConfig.prompt_chunk), the last one gives the first token, then
    # one run per token
    assert PROMPT_CHUNK == 63 and res.stats.n_runs == 2 + 63
    # the chunks flow through the stages one behind the other: (2 + N - 1) stage costs and N link hops
    prompt_s = res.stats.t_prompt_done_s - res.stats.t_start_s
    assert prompt_s == pytest.approx((2 + n_stages - 1) * 0.010 + n_stages * 1e-3, rel=1e-9)


def test_bandwidth_adds_each_message_transfer_time():
    # DECODE to the next stage: header 36 B + META + activations (1 token x 64 floats); RESULT: 36 + 4 bytes
    bw = 1e6  # 1 MB/s: transfer times are milliseconds, well above float noise
    res = simulate(equal_stages(2, ms=10.0, bandwidth_Bps=bw), gen("iterative"))
    meta_bytes = 4 * len(Batch(np.zeros(1, np.int32), np.zeros(1, np.int32), [[0]], np.ones(1, np.int32), kv_ops()).pack_meta())
    forward = 4 * HEADER_LEN + meta_bytes + 4 * 64
    back = 4 * HEADER_LEN + 4
    assert res.stats.itl_s == pytest.approx(2 * 0.010 + (forward + back) / bw, rel=1e-9)


@pytest.mark.parametrize("n_stages", [2, 4, 8])
@pytest.mark.parametrize("draft_max", [1, 2, 3])
def test_perfect_free_draft_reaches_one_micro_batch_per_stage_cost(n_stages, draft_max):
    # agreement 1, drafting free, a micro-batch costs what one token costs: the head launches a run every
    # stage cost and every run is accepted whole, so ITL -> stage cost / draft_max (prompt ramp aside)
    res = simulate(equal_stages(n_stages), gen("pipeinfer", 256, draft_max), agreement=1.0, max_in_flight=n_stages + 1)
    assert res.stats.n_cancelled == 0 and res.stats.acceptance_rate > 0.98  # drafts past the last token go unused
    assert res.stats.itl_s == pytest.approx(0.010 / draft_max, rel=0.02)


def test_speculative_waits_a_whole_pass_per_tree():
    # synchronous: [last token] + 2 drafts, all accepted -> 3 tokens per pass of N x cost
    res = simulate(equal_stages(4), gen("speculative", 90, draft_max=2), agreement=1.0)
    assert res.stats.itl_s == pytest.approx(4 * 0.010 / 3, rel=0.02)


def test_draft_cost_on_the_head_delays_the_pipeline_and_own_host_hides_it():
    on_head = simulate(equal_stages(4, draft_ms=5.0), gen("pipeinfer", 128, 1), agreement=1.0)
    own = simulate(equal_stages(4, draft_ms=5.0, draft_on="own"), gen("pipeinfer", 128, 1), agreement=1.0)
    # on the head every launch costs stage (10 ms) + draft (5 ms); a draft host drafting ahead costs nothing
    assert on_head.stats.itl_s == pytest.approx(0.015, rel=0.02)
    assert own.stats.itl_s == pytest.approx(0.010, rel=0.02)


def test_cancel_aborts_a_decode_at_its_next_check():
    # stage 1 decodes run 2 (100 ms); the head cancels it at t=30 ms; with 2 ms latency and a 1 ms check
    # the stage is free at 33 ms and passes an empty result back (arriving at 35 ms)
    c = VirtualClock()
    cl = Cluster([StageCost([0.0], 0.0), StageCost([100.0], 0.0)], [Link(2e-3, 1e18)] * 2, 8,
                 head_overhead_ms=0.0, abort_check_ms=1.0)
    pipe = SimPipeline(cl, list(range(100)), c)
    b = Batch(np.array([5], np.int32), np.array([10], np.int32), [[1]], np.ones(1, np.int32), kv_ops())
    pipe.launch(2, b, speculative=True)
    c.advance_to(0.030)
    pipe.cancel([2])
    res = pipe.next_result()
    assert res.cancelled and res.run_id == 2
    assert c() == pytest.approx(0.030 + 0.002 + 0.001 + 0.002, abs=1e-9)  # cancel hop, abort check, result hop
    assert pipe.stages[1].trace.n_cancelled_mid == 1


def test_non_speculative_runs_are_never_aborted():
    c = VirtualClock()
    cl = Cluster([StageCost([0.0], 0.0), StageCost([100.0], 0.0)], [Link(0.0, 1e18)] * 2, 8, head_overhead_ms=0.0)
    pipe = SimPipeline(cl, list(range(100)), c)
    b = Batch(np.array([5], np.int32), np.array([10], np.int32), [[0]], np.ones(1, np.int32), kv_ops())
    pipe.launch(1, b, speculative=False)
    c.advance_to(0.010)  # stage 1 has started it (a run cancelled before it starts is skipped, as worker.py does)
    pipe.cancel([1])
    res = pipe.next_result()
    assert not res.cancelled and res.tokens.tolist() == [11] and c() == pytest.approx(0.100)


def test_low_agreement_cancels_and_stays_exact():
    # the Head checks the twin's output against its reference; here many runs are cancelled and compacted
    res = simulate(equal_stages(4, by_batch=[10, 12, 14, 16]), replace_ctx(gen("pipeinfer", 400, 3, None, 0.3)),
                   agreement=0.4)
    assert res.stats.n_cancelled > 0 and res.stats.n_compactions > 0
    assert res.tokens == reference_tokens(64, 400)[64:464]


def replace_ctx(g: GenConfig) -> GenConfig:
    from dataclasses import replace
    return replace(g, n_ctx=600)  # 64 + 400 tokens and the runs' garbage: compacted now and then


# ---- the commands, on a profile written by hand (twin_cases.hand_profile)
def test_simulate_command_prints_stats_and_writes_a_twin_row(tmp_path):
    from pipeinfer.core.results import read_results
    prof = hand_profile(tmp_path)
    csv = tmp_path / "r.csv"
    out = run_cli(["simulate", "--profile", str(prof), "--mode", "pipeinfer", "-n", "64", "--agreement", "0.8",
                   "--results", str(csv)])
    assert out.returncode == 0, out.stderr
    assert "generation speed" in out.stdout and "rank 1: busy" in out.stdout
    rows = read_results(csv)
    assert rows[0]["simulated"] == "twin" and rows[0]["n_generated"] == 64 and rows[0]["gen_tokens_per_s"] > 0
    js = run_cli(["simulate", "--profile", str(prof), "--mode", "iterative", "-n", "16", "--json"])
    stats = json.loads(js.stdout)["stats"]
    # iterative on the profiled split: rank 0 (21 ms) + rank 1 (2 x 31 ms) + two links of 100 us + polling
    assert stats["itl_s"] == pytest.approx(0.021 + 0.062 + 2 * (1e-4 + 0.00025) + 0.2 * (0.1 + 0.25) / 1e3, rel=0.02)


def test_simulate_refuses_a_file_that_is_not_a_profile(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    out = run_cli(["simulate", "--profile", str(bad)])
    assert out.returncode != 0 and "not a pipeinfer profile" in out.stderr and "Traceback" not in out.stderr


def test_plan_moves_layers_off_the_slow_host(tmp_path):
    prof = hand_profile(tmp_path, slow=2.0)
    out = run_cli(["plan", "--profile", str(prof), "--agreement", "0.7", "-n", "48"])
    assert out.returncode == 0, out.stderr
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("pipeinfer launch --hostfile hosts.txt -- generate")
    split = [float(x) for x in line.split("--layer-split ")[1].split()[0].split(",")]
    assert split[0] > 0.5  # the head's (fast) host takes the larger share


def test_measured_draft_proposes_what_clears_the_cutoff():
    from pipeinfer.twin.sim import _ConfidenceReplay
    # sure and right, or unsure and wrong: a cutoff between the two proposes only right tokens
    pairs = [[0.9, 1]] * 7 + [[0.2, 0]] * 3
    unsure = _ConfidenceReplay(list(range(100)), [[0.0, 0]], seed=0, burner=None)
    assert unsure.draft(list(range(10)), Cutoffs(0.0, 0.1, 4, 1)) == []   # proposed nothing there
    cl = equal_stages(2, draft_ms=1.0)
    strict = simulate(cl, gen("pipeinfer", 96, 1, p_accept=0.5), confidence=pairs).stats
    loose = simulate(cl, gen("pipeinfer", 96, 1, p_accept=0.1), confidence=pairs).stats
    assert strict.acceptance_rate == 1.0 and strict.n_cancelled == 0
    assert 0.55 < loose.acceptance_rate < 0.85 and loose.n_drafted > strict.n_drafted
    never = simulate(cl, gen("pipeinfer", 32, 1, p_accept=0.95), confidence=pairs).stats
    assert never.n_drafted == 0 and never.n_draft_calls > 0


def test_measured_draft_keeps_its_streaks():
    """Pairs are drawn in measured order, BLOCK at a time: right and wrong come in runs, as they were measured
    (independent draws would make neighbours agree half the time here)."""
    from pipeinfer.twin.sim import _ConfidenceReplay
    d = _ConfidenceReplay(list(range(900)), [[0.9, 1]] * 8 + [[0.9, 0]] * 8, seed=3, burner=None)
    right = [d.pair(pos)[1] for pos in range(800)]
    same = [right[i] == right[i + 1] for i in range(799) if (i + 1) % d.BLOCK]
    assert sum(same) / len(same) > 0.8
    assert 0.35 < sum(right) / len(right) < 0.65


def test_plan_chooses_the_cutoff_from_the_measured_draft(tmp_path):
    """With the draft's measured confidence plan searches -pa: here wrong drafts are the unsure ones, and
    cutting them off (-pa >= 0.3) beats proposing everything."""
    from pipeinfer.decide.genconfig import GenConfig
    from pipeinfer.twin.plan import load_profile, search
    prof = load_profile(str(hand_profile(tmp_path, slow=1.0)))
    prof["draft"]["confidence"] = [[0.95, 1]] * 6 + [[0.2, 0]] * 4
    best = search(prof, agreement=0.7, n_predict=64, exact_limit=3, draft_own_host=False,
                  base=GenConfig(stop_at_eos=False), confidence=prof["draft"]["confidence"])
    assert best["pipeinfer"].p_accept >= 0.3 and best["speculative"].p_accept >= 0.3
    out = run_cli(["plan", "--profile", str(tmp_path / "profile.json"), "-n", "32"])
    assert out.returncode == 0 and "agreement 0.7" in out.stdout   # no confidence in the file: --agreement's default
    (tmp_path / "m.json").write_text(json.dumps(prof))
    out = run_cli(["plan", "--profile", str(tmp_path / "m.json"), "-n", "32"])
    assert out.returncode == 0, out.stderr
    assert "measured confidence (10 positions)" in out.stdout and " -pa 0." in out.stdout


def test_plan_tries_token_trees_where_the_draft_names_runner_ups(tmp_path):
    """Rows nearly free (the hand profile's stages: 2.0 / 2.2 / 2.4 ms a layer for 1 / 2 / 3 rows), a draft right
    in 0.3 of its tokens (all proposed: -pa 0.1) whose runner-up is right wherever it is wrong: trees beat the
    chain, and plan picks them; without runner-ups plan does not try them."""
    from pipeinfer.decide.genconfig import GenConfig
    from pipeinfer.twin.plan import launch_line, load_profile, search
    prof = load_profile(str(hand_profile(tmp_path, slow=1.0)))
    kw = dict(agreement=0.3, n_predict=64, exact_limit=3, draft_own_host=False,
              base=GenConfig(stop_at_eos=False, p_accept=0.1, draft_max=3))
    trees, chain = search(prof, runner_up=1.0, **kw), search(prof, **kw)
    assert trees["pipeinfer"].branches == 4 and chain["pipeinfer"].branches == 1
    assert trees["pipeinfer"].tokens_per_s > 1.03 * chain["pipeinfer"].tokens_per_s
    assert "--max-branches 4" in launch_line(prof, trees["pipeinfer"])
    assert "--max-branches" not in launch_line(prof, chain["pipeinfer"])
    sim = run_cli(["simulate", "--profile", str(tmp_path / "profile.json"), "-n", "48", "--agreement", "0.3",
                   "-pa", "0.1", "--runner-up", "1.0", "--max-branches", "4"])
    assert sim.returncode == 0, sim.stderr
    assert "siblings" in sim.stdout
    out = run_cli(["plan", "--profile", str(tmp_path / "profile.json"), "-n", "32", "--runner-up", "0.5"])
    assert out.returncode == 0, out.stderr


def test_plan_counts_draft_calls_that_propose_nothing(tmp_path):
    """A draft below its cutoff at most calls still costs each call: plan predicts less for it."""
    from pipeinfer.decide.genconfig import GenConfig
    from pipeinfer.twin.plan import load_profile, search
    prof = load_profile(str(hand_profile(tmp_path, slow=1.0)))
    prof["draft"]["ms_per_token"] = 10.0
    kw = dict(agreement=0.9, n_predict=48, exact_limit=3, draft_own_host=False, base=GenConfig(stop_at_eos=False))
    always, half = search(prof, **kw), search(prof, propose=0.5, **kw)
    assert half["pipeinfer"].tokens_per_s < 0.95 * always["pipeinfer"].tokens_per_s
    assert half["iterative"].tokens_per_s == always["iterative"].tokens_per_s


def test_the_twin_charges_a_translated_draft_its_measured_cost_per_proposal(tmp_path):
    from pipeinfer.twin.plan import Shape, build_cluster, load_profile
    prof = load_profile(str(hand_profile(tmp_path, slow=1.0)))
    assert build_cluster(prof, Shape()).draft_ms_per_token == 1.0
    prof["draft"]["translating"] = {"ms_per_proposal": 2.5, "proposals_per_call": 3.0, "decodes_per_proposal": 1.2}
    assert build_cluster(prof, Shape()).draft_ms_per_token == 2.5
    assert build_cluster(prof, Shape(hosts=4, n_layer=80)).draft_ms_per_token == 2.5
    assert build_cluster(prof, Shape(draft_ms=1.0)).draft_ms_per_token == 1.0   # the replay instrument's burner


def test_scaled_cluster_prices_a_larger_model(tmp_path):
    from pipeinfer.twin.plan import Shape, build_cluster, load_profile
    prof = load_profile(str(hand_profile(tmp_path, slow=1.0)))
    small = build_cluster(prof, Shape(hosts=2))
    big = build_cluster(prof, Shape(hosts=4, n_layer=80, layer_scale=10.0, out_scale=3.0))
    assert small.stages[0].ms(1) == pytest.approx(21.0)          # 1 + 10 x 2
    assert big.stages[0].ms(1) == pytest.approx(1 + 20 * 20.0)    # 80 layers over 4 hosts, 10x per layer
    assert big.stages[-1].ms(1) == pytest.approx(1 + 20 * 20.0 + 30.0)


def test_ranks_sharing_a_machine_slow_each_other_only_when_they_overlap():
    shared = equal_stages(2)
    shared.machine_of, shared.shared_slowdown = ["m", "m"], 2.0
    # iterative: one stage computes at a time, nothing overlaps
    assert simulate(shared, gen("iterative")).stats.itl_s == pytest.approx(0.020, rel=1e-9)
    # a perfect free draft keeps both busy: every decode overlaps the other rank's and takes twice as long
    res = simulate(shared, gen("pipeinfer", 256, 1), agreement=1.0)
    assert res.stats.itl_s == pytest.approx(0.020, rel=0.03)
    apart = equal_stages(2)
    apart.machine_of, apart.shared_slowdown = ["m", "n"], 2.0
    assert simulate(apart, gen("pipeinfer", 256, 1), agreement=1.0).stats.itl_s == pytest.approx(0.010, rel=0.03)


def test_more_busy_ranks_than_cores_time_share_the_machine():
    # three ranks on a 2-core machine, no bandwidth effect: a decode that starts while both others compute
    # runs at 2/3 speed (3 busy / 2 cores); with 3 cores it would not slow down
    def cl(cores):
        c = equal_stages(3)
        c.machine_of, c.cores_of, c.shared_slowdown = ["m"] * 3, [cores] * 3, 1.0
        return c
    busy = simulate(cl(2), gen("pipeinfer", 256, 1), agreement=1.0).stats.itl_s
    roomy = simulate(cl(3), gen("pipeinfer", 256, 1), agreement=1.0).stats.itl_s
    assert roomy == pytest.approx(0.010, rel=0.03)
    assert busy == pytest.approx(0.015, rel=0.05)


@pytest.mark.mpi
@pytest.mark.parametrize("n_ranks", [None, 2])
def test_profile_writes_what_simulate_needs(models, tmp_path, n_ranks):
    # one process measuring a 2-stage split in turn, and 2 MPI ranks (links, shared slowdown, calibration)
    out = tmp_path / "p.json"
    args = ["profile", "-m", str(models["q8"]), "--draft", str(models["draft90"]), "--max-batch", "3", "-o", str(out)]
    p = run_cli(args + (["--ranks", "2"] if n_ranks is None else []), n=n_ranks, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    prof = json.loads(out.read_text())
    assert [r["layers"] for r in prof["ranks"]] == [[0, 2], [2, 4]] and prof["ranks"][1]["last"]
    assert all(len(r["ms_by_batch"]) == 3 and min(r["ms_by_batch"]) > 0 for r in prof["ranks"])
    assert len(prof["layer_model"]["layer_ms"]) == 3 and prof["draft"]["ms_per_token"] > 0
    assert prof["exact_batch"] >= 1 and prof["head_overhead_ms"] > 0
    if n_ranks:
        assert [(lk["from"], lk["to"]) for lk in prof["links"]] == [(0, 1), (1, 0)]
        assert all(lk["bandwidth_bps"] > 0 for lk in prof["links"])
        assert all(r["in_pipeline_factor"] > 0 for r in prof["ranks"])
        # the draft's confidence along the target's own output: [p, right, runner-up's p, runner-up right] per
        # position (a draft of the target's vocabulary names its runner-up), mostly right
        conf = prof["draft"]["confidence"]
        assert len(conf) == 64 and all(len(c) == 4 and 0.0 <= c[0] <= 1.0 and c[1] in (0, 1) and 0.0 <= c[2] <= c[0]
                                       and c[3] in (0, 1) and not (c[1] and c[3]) for c in conf if c[0] > 0)
        assert sum(c[1] for c in conf) >= 0.6 * len(conf)
        measured = run_cli(["simulate", "--profile", str(out), "-n", "16", "--measured-draft", "--json"])
        assert measured.returncode == 0, measured.stderr
        assert json.loads(measured.stdout)["stats"]["n_drafted"] > 0
    else:
        refused = run_cli(["simulate", "--profile", str(out), "--measured-draft", "--bandwidth-mbit", "1000"])
        assert refused.returncode != 0 and "no measured draft confidence" in refused.stderr
        no_links = run_cli(["simulate", "--profile", str(out)])   # one process measured no links
        assert no_links.returncode != 0 and "no link from rank 0" in no_links.stderr
        assert "Traceback" not in refused.stderr + no_links.stderr
    sim = run_cli(["simulate", "--profile", str(out), "-n", "16", "--json"]
                  + (["--bandwidth-mbit", "1000"] if n_ranks is None else []))
    assert sim.returncode == 0, sim.stderr
    assert json.loads(sim.stdout)["stats"]["n_generated"] == 16
