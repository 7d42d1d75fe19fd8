"""The twin serving many clients with the real scheduler (twin/sim.py simulate_clients, decide/scheduler.py):
each request answered from its own reference, throughput near the stages' limit once every stage has a
generation, one client as fast as simulate()'s PipeInfer, Poisson arrivals, and `pipeinfer plan --clients`."""
import json
from dataclasses import replace

import pytest

from twin_cases import equal_stages, gen, hand_profile

from pipeinfer.core.kvplan import garbage_seq, lane_count, lane_seq_max

from pipeinfer.twin import sim
from pipeinfer.twin.cluster import Link
from pipeinfer.twin.sim import simulate, simulate_clients, throughput_limit

from conftest import cli as run_cli


def uniform(n_stages: int = 4):
    """Equal 10 ms stages, 100 us links at 1 Gbit/s, a 1 ms draft on the head: the limit is 100 tokens/s."""
    return equal_stages(n_stages, ms=10.0, latency_s=1e-4, bandwidth_Bps=125e6, draft_ms=1.0)


@pytest.mark.parametrize("cache_prompt", [False, True])
@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_answers_equal_their_references_under_concurrency(mode, cache_prompt):
    # low agreement: cancellations, several generations at once and compactions, each answer checked inside. A
    # finished generation's slot is clean again only after a COMPACT (these 12-token prompts leave no cache entry):
    # one request more than the scheduler's slots (2 x 3, and 16 more with the prompt cache) needs one
    n_requests = lane_count(3, cache_prompt) + 1
    res = simulate_clients(uniform(3), replace(gen(mode, 40, 2, None), cache_prompt=cache_prompt), n_clients=5,
                           n_requests=n_requests, n_prompt=12, n_parallel=3, agreement=0.5, seed=4)
    assert [r.n_tokens for r in res.requests] == [40] * n_requests
    assert res.sched.max_active == 3 and res.sched.n_compactions > 0
    assert res.sched.n_lends > 0 if mode == "pipeinfer" else res.sched.n_lends == 0
    if mode == "iterative":   # as many requests as slots: none waits for a compaction
        fits = simulate_clients(uniform(3), replace(gen(mode, 40, 2, None), cache_prompt=cache_prompt), n_clients=5,
                                n_requests=n_requests - 1, n_prompt=12, n_parallel=3, agreement=0.5, seed=4)
        assert fits.sched.n_compactions == 0


@pytest.mark.parametrize("cache_prompt", [False, True])
@pytest.mark.parametrize("n_parallel", [1, 3])
@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_the_twin_plans_the_sequences_of_the_schedulers_slots(monkeypatch, mode, n_parallel, cache_prompt):
    """The partition pool is planned for the scheduler's slots (lane_count(n_parallel, cache_prompt), as startup.py
    plans a real context): the garbage sequence is the context's last id, after every slot's canonical one."""
    made = []

    class Recording(sim.Scheduler):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)
    monkeypatch.setattr(sim, "Scheduler", Recording)
    g = replace(gen(mode, 8, 2, None), cache_prompt=cache_prompt)
    simulate_clients(uniform(2), g, n_clients=1, n_requests=1, n_prompt=8, n_parallel=n_parallel)
    if n_parallel == 1:
        simulate(uniform(2), g, n_prompt=8)
    for sched in made:
        assert sched.slots.n_lanes == lane_count(n_parallel, cache_prompt)
        if mode == "pipeinfer":
            n_part = sched.pool.n_partitions
            assert sched.pool.garbage_seq == garbage_seq(lane_seq_max(n_part, sched.cfg.max_branches, sched.slots.n_lanes))
            assert sched.pool.garbage_seq > max(sched.slots.canon)


def test_a_run_answered_from_another_generation_is_caught(monkeypatch):
    """The check is live: route every run to request 0's reference and the other answers differ."""
    monkeypatch.setattr(sim._Clients, "reference_of_prompt", lambda self, prompt: self.refs[0])
    with pytest.raises(RuntimeError, match="differs from its reference"):
        simulate_clients(uniform(2), gen("iterative", 16), n_clients=2, n_requests=2, n_prompt=8, n_parallel=2)


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_clients_equal_to_stages_reach_the_limit(mode):
    cl = uniform(4)
    assert throughput_limit(cl) == pytest.approx(100.0, rel=0.01)
    res = simulate_clients(cl, gen(mode, 64, 1, None), n_clients=4, n_requests=8, n_prompt=16, n_parallel=4,
                           agreement=0.8)
    assert res.fraction_of_limit >= 0.9


@pytest.mark.parametrize("n_parallel", [1, 4])
def test_one_client_is_as_fast_as_pipeinfer_alone(n_parallel):
    cl, g = uniform(4), gen("pipeinfer", 64, 1, None)
    alone = simulate(cl, g, agreement=0.8, n_prompt=16, seed=3).stats
    res = simulate_clients(cl, g, n_clients=1, n_requests=1, n_prompt=16, n_parallel=n_parallel, agreement=0.8, seed=3)
    assert res.requests[0].latency_s == pytest.approx(alone.t_last_s - alone.t_start_s, rel=0.03)
    assert res.requests[0].ttft_s == pytest.approx(alone.t_prompt_done_s - alone.t_start_s, rel=0.03)


def test_poisson_arrivals_all_finish_and_idle_time_is_skipped():
    cl, g = uniform(4), gen("pipeinfer", 32, 1, None)
    one = simulate_clients(cl, g, n_clients=1, n_requests=1, n_prompt=16, agreement=0.8).requests[0].latency_s
    sparse = simulate_clients(cl, g, rate_per_s=0.05, n_requests=6, n_prompt=16, n_parallel=4, agreement=0.8)
    arrivals = [r.t_arrival_s for r in sparse.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 20 * one   # the clock jumped to each arrival
    assert all(r.n_tokens == 32 for r in sparse.requests)
    assert all(r.latency_s < 1.5 * one for r in sparse.requests)        # rarely two at once
    busy = simulate_clients(cl, g, rate_per_s=80.0 / 32, n_requests=12, n_prompt=16, n_parallel=4, agreement=0.8)
    assert len(busy.requests) == 12 and busy.sched.max_active > 1 and busy.p95_latency_s >= busy.p50_latency_s


def test_throughput_limit_is_the_slowest_server():
    # head: 10 ms decode + a launch and a result of 1 ms; a slow last stage; then a thin link
    cl = equal_stages(3, ms=10.0)
    cl.head_overhead_ms = 1.0
    assert throughput_limit(cl) == pytest.approx(1 / 0.012)
    cl.stages = cl.stages[:2] + [type(cl.stages[0])([20.0], 0.0)]
    assert throughput_limit(cl) == pytest.approx(50.0)
    cl.links = [Link(1.0, 1e3)] * 3   # a token's activations (64 floats + header + metadata) take > 256 ms
    assert throughput_limit(cl) < 4.0
    with pytest.raises(ValueError, match="not both"):
        simulate_clients(cl, gen("iterative"), n_clients=1, rate_per_s=1.0, n_requests=1)


def test_plan_clients_reports_three_schedules(tmp_path):
    prof = hand_profile(tmp_path, slow=1.0)
    out = run_cli(["plan", "--profile", str(prof), "--agreement", "0.8", "-n", "24", "--n-prompt", "8",
                   "--clients", "2"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "2 closed-loop clients" in lines[0] and "the stages' limit" in lines[1]
    assert [ln.split()[0] for ln in lines[2:5]] == ["pipeinfer", "interleaving", "default"]
    assert "--parallel 1 " in lines[2] and "--parallel 8 " in lines[3] and "% of the limit" in lines[4]
    assert "fastest:" not in out.stdout   # the one-stream search is not run
    assert lines[-2].startswith("recommended: --parallel ") and lines[-1].startswith("run: pipeinfer launch ")


def kernel_profiles(tmp_path):
    """The hand profile's cluster under two kernels, as measured on the 2-core EPYC: repacked rows that cost what
    each costs alone (3 rows 3x one), and a tiled kernel that charges a lone row 3x and 8 rows hardly more."""
    prof = json.loads(hand_profile(tmp_path, slow=1.0).read_text())
    out = []
    for kernels, limit, cost in (("repack", 3, lambda one, b: one * b), ("tiled", 8, lambda one, b: 3 * one * (1 + 0.02 * b))):
        p = dict(prof, kernels=kernels, exact_batch=limit,
                 ranks=[dict(r, ms_by_batch=[round(cost(r["ms_by_batch"][0], b), 3) for b in range(1, limit + 1)])
                        for r in prof["ranks"]])
        path = tmp_path / f"{kernels}.json"
        path.write_text(json.dumps(p))
        out.append(path)
    return out


@pytest.mark.parametrize("clients, kernels", [(1, "repack"), (16, "tiled")])
def test_plan_clients_chooses_the_kernels_from_a_profile_of_each(tmp_path, clients, kernels):
    """plan --clients with a profile per --kernels setting: each setting's schedules, then the faster one's command;
    a lone client wants the cheap lone row, many want the cheap wide batch."""
    repack, tiled = kernel_profiles(tmp_path)
    out = run_cli(["plan", "--profile", str(repack), "--profile", str(tiled), "--agreement", "0.8", "-n", "16",
                   "--n-prompt", "8", "--clients", str(clients)])
    assert out.returncode == 0, out.stderr
    assert "--kernels repack (exact batch limit 3):" in out.stdout and "--kernels tiled (exact batch limit 8):" in out.stdout
    fastest = [ln for ln in out.stdout.splitlines() if ln.startswith("fastest for")]
    assert fastest and f"--kernels {kernels}," in fastest[0], out.stdout
    run = out.stdout.splitlines()[-1]
    assert run.startswith("run: pipeinfer launch ") and (("--kernels tiled" in run) == (kernels == "tiled"))


def test_plan_refuses_profiles_it_cannot_compare(tmp_path):
    repack, tiled = kernel_profiles(tmp_path)
    for args, why in ((["--profile", str(repack), "--profile", str(repack), "--clients", "2"], "one profile per"),
                      (["--profile", str(repack), "--profile", str(tiled)], "go with --clients")):
        out = run_cli(["plan", *args])
        assert out.returncode == 2 and why in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_the_twins_rounds_are_plans_that_keep_the_batching_rules(monkeypatch):
    """Every round of a batched twin run is a plan (decide/planner.py) over what the scheduler saw: prompt chunks
    beyond the stages only where they join rows held, the drafter to the oldest decoding generation, lent only to
    ride where more decode than the pipeline is deep; the executor holds what the plan said it would."""
    rounds = []

    class Recording(sim.Scheduler):
        def _execute(self, plan):
            rounds.append((self._view(), plan, self.rules))
            super()._execute(plan)
    monkeypatch.setattr(sim, "Scheduler", Recording)
    g = replace(gen("pipeinfer", 24, 2, None), batch_rows=8, prompt_chunk=4, draft_rides="always")
    res = simulate_clients(uniform(3), g, n_clients=6, n_requests=12, n_prompt=20, n_parallel=6, agreement=0.7)
    assert [r.n_tokens for r in res.requests] == [24] * 12
    plans = [p for _, p, _ in rounds]
    assert any(p.compact for p in plans) or res.sched.n_compactions == 0
    assert any(len(p.feeds) > 1 for p in plans) and any(p.to_ride for p in plans) and any(p.speculate for p in plans)
    for view, plan, rules in rounds:
        if plan.compact:
            assert not plan.feeds and plan.lend_to is None
            continue
        beyond = sum(v.prompt_in_flight for v in view.gens) + len(plan.feeds) - rules.n_stages
        assert not plan.feeds or beyond <= 0 or plan.held.n_rows > 0
        fed = [plan.feeds.count(i) for i in range(len(view.gens))]
        decoding = [i for i, v in enumerate(view.gens) if not v.done and not v.background and len(v.chunks) == fed[i]]
        assert plan.lend_to in (None, decoding[0] if decoding else None)
        assert plan.to_ride == (plan.lend_to is not None and len(decoding) >= rules.depth and len(view.gens) > 1)
