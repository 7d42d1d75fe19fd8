"""The twin's prompt processing (twin/sim.py, twin/cluster.py): prompts in chunks of GenConfig.prompt_chunk that flow
through the stages one behind the other, what a chunk costs by the profile, the prompt cache on multi-turn chat
(simulate_conversations, `pipeinfer plan --conversations`), and uncached prompt speed on S stages against one."""
import math
from dataclasses import replace

import pytest

from twin_cases import equal_stages, gen, hand_profile

from pipeinfer.core.config import PROMPT_CHUNK
from pipeinfer.core.prefixcache import whole_chunks
from pipeinfer.twin import sim
from pipeinfer.twin.cluster import PROMPT_PROBE_ROWS, Cluster, Link, StageCost, cluster_from_profile
from pipeinfer.twin.plan import Shape, load_profile, prompt_speedup
from pipeinfer.twin.sim import (
    compare_prompt_cache,
    conversation_prompts,
    one_stage_prompt_s,
    simulate,
    simulate_conversations,
)

from conftest import ROOT
from conftest import cli as run_cli

C = PROMPT_CHUNK


def chunky(n_stages: int, ms_per_token: float = 1.0) -> Cluster:
    """Equal stages whose batch cost grows with its rows (a 63-row chunk: about 62 ms), free links, no overhead."""
    cl = equal_stages(n_stages)
    cl.stages = [StageCost([10.0, 11.0, 12.0, 13.0], ms_per_token)] * n_stages
    return cl


def prompt_s(stats) -> float:
    return stats.t_prompt_done_s - stats.t_start_s


def flow_s(st: StageCost, n_prompt: int, n_stages: int) -> float:
    """A prompt's chunks through S equal stages, free links: every chunk costs the same on every stage (a
    proportionate flow shop), so the last chunk leaves the last stage after the chunks' sum + (S - 1) x the
    largest chunk's time."""
    sizes = [min(C, n_prompt - k) for k in range(0, n_prompt, C)]
    return (sum(st.ms(n) for n in sizes) + (n_stages - 1) * max(st.ms(n) for n in sizes)) / 1e3


# ---- what a chunk costs
def test_a_chunk_costs_what_the_profile_measured_for_its_rows():
    from pipeinfer.twin.profile import N_PROMPT_PROBE
    assert N_PROMPT_PROBE == PROMPT_PROBE_ROWS == 64
    st = StageCost([10.0, 11.0, 12.0, 13.0], 2.0, out_ms_per_row=0.5)
    assert [st.ms(n) for n in (1, 4)] == [10.0, 13.0]                   # the table
    assert st.ms(64) == pytest.approx(64 * 2.0)                          # the probe: 64 rows, each 2 ms
    assert st.ms(34) == pytest.approx(13.0 + 30 / 60 * (128.0 - 13.0))  # between: linear
    assert st.ms(200) == pytest.approx(400.0)                            # beyond: per row
    # a prompt chunk's rows are not outputs (but its last, in the last chunk): a last stage skips their projection
    assert st.ms(C, 0) == pytest.approx(st.ms(C) - C * 0.5)
    assert st.ms(C, 1) == pytest.approx(st.ms(C) - (C - 1) * 0.5)
    assert st.ms(3, 0) == st.ms(3)                                       # decode-sized batches: as measured
    flat = StageCost([100.0], 0.0)                                       # no prompt cost measured: never cheaper
    assert flat.ms(C) == 100.0


def test_the_last_stage_of_a_profile_pays_the_projection_per_output_row(tmp_path):
    prof = load_profile(str(hand_profile(tmp_path)))
    cl = cluster_from_profile(prof)
    lm = prof["layer_model"]
    share = lm["prompt_out_ms_per_token"] / (lm["prompt_fixed_ms_per_token"] + 10 * lm["prompt_layer_ms_per_token"]
                                             + lm["prompt_out_ms_per_token"])
    assert cl.stages[0].out_ms_per_row == 0.0
    assert cl.stages[1].out_ms_per_row == pytest.approx(prof["ranks"][1]["prompt_ms_per_token"] * share)
    scaled = cluster_from_profile(prof, fractions=[0.5, 0.5])
    assert scaled.stages[0].out_ms_per_row == 0.0 and scaled.stages[1].out_ms_per_row > 0.0


# ---- chunks through the stages
@pytest.mark.parametrize("n_stages", [2, 4, 8])
@pytest.mark.parametrize("n_chunks", [1, 3, 10])
def test_a_prompt_takes_chunks_plus_stages_minus_one_chunk_times(n_stages, n_chunks):
    # P = n_chunks whole chunks on S balanced stages: the head decodes chunk k+1 while stage 1 decodes chunk k, so
    # the last chunk leaves the last stage (n_chunks + S - 1) chunk-times after the first one started
    cl = chunky(n_stages)
    res = simulate(cl, gen("iterative", 2), n_prompt=n_chunks * C)
    assert res.stats.n_runs == n_chunks + 1
    assert prompt_s(res.stats) == pytest.approx((n_chunks + n_stages - 1) * cl.stages[0].ms(C) / 1e3, rel=1e-9)
    assert all(s["n_decoded"] == n_chunks + 1 for s in res.stages)


def test_a_long_prompt_is_about_its_chunks_and_a_pipeline_fill():
    # 2000 tokens: 31 chunks of 63 and one of 47; links and the head's overhead add a little
    cl = chunky(8)
    cl.links = [Link(1e-4, 125e6)] * 8
    cl.head_overhead_ms = 0.1
    res = simulate(cl, gen("iterative", 2), n_prompt=2000)
    n = math.ceil(2000 / C)
    assert res.stats.n_runs == n + 1
    assert prompt_s(res.stats) == pytest.approx((n + 8 - 1) * cl.stages[0].ms(C) / 1e3, rel=0.03)
    assert prompt_s(res.stats) >= flow_s(cl.stages[0], 2000, 8)


def test_a_chunk_size_other_than_the_default():
    cl = chunky(4)
    res = simulate(cl, replace(gen("iterative", 2), prompt_chunk=16), n_prompt=128)
    assert res.stats.n_runs == 8 + 1
    assert prompt_s(res.stats) == pytest.approx((8 + 4 - 1) * cl.stages[0].ms(16) / 1e3, rel=1e-9)


# ---- conversations and the prompt cache
def test_conversation_prompts_grow_by_an_answer_and_a_message():
    assert conversation_prompts(100, 4, 32, 40) == [100, 172, 244, 316]


@pytest.mark.parametrize("n_stages", [2, 4])
def test_one_conversation_starts_each_turn_from_the_last_turns_chunks(n_stages):
    # one client, nothing else running: each turn's time to first token is its chunks + S - 1 chunk-times; with
    # the cache the chunks are those after the previous turn's whole chunks
    cl = chunky(n_stages)
    kw = dict(n_conversations=1, n_turns=4, n_user=40, n_first=100, think_s=1.0)
    cmp = compare_prompt_cache(cl, gen("iterative", 32), **kw)
    lengths = conversation_prompts(100, 4, 32, 40)
    for t, (off, on) in enumerate(zip(cmp.uncached.requests, cmp.cached.requests)):
        cached = whole_chunks(lengths[t - 1], C) if t else 0
        assert (off.n_prompt, on.n_prompt) == (lengths[t], lengths[t])
        assert (off.n_cached, on.n_cached) == (0, cached)
        assert off.ttft_s == pytest.approx(flow_s(cl.stages[0], lengths[t], n_stages), rel=1e-6)
        assert on.ttft_s == pytest.approx(flow_s(cl.stages[0], lengths[t] - cached, n_stages), rel=1e-6)
    assert cmp.cached.later_ttft_mean_s < 0.8 * cmp.uncached.later_ttft_mean_s
    # the clients thought 1 s between turns: the second turn was sent 1 s after the first answer
    r0, r1 = cmp.cached.requests[:2]
    assert r1.t_arrival_s == pytest.approx(r0.t_done_s + 1.0)


@pytest.mark.parametrize("mode", ["iterative", "pipeinfer"])
def test_conversations_answer_their_references_with_and_without_the_cache(mode):
    # several conversations at once, low agreement (cancellations, compactions): every answer is checked against
    # its conversation's stream inside (a wrong one raises); the cache lowers turn 2+'s time to first token
    cl = equal_stages(3, ms=10.0, latency_s=1e-4, bandwidth_Bps=125e6, draft_ms=1.0)
    cl.stages = [StageCost([10.0, 11.0, 12.0], 0.5)] * 3
    cmp = compare_prompt_cache(cl, gen(mode, 24, 2, None), n_parallel=3, n_conversations=4, n_turns=3, n_user=30,
                               n_first=90, agreement=0.5, seed=2)
    for res in (cmp.uncached, cmp.cached):
        assert [r.n_tokens for r in res.requests] == [24] * 12 and res.n_turns == 3 and len(res.later_turns) == 8
    assert cmp.uncached.cached_share == 0.0 and cmp.cached.cached_share > 0.3
    assert all(r.n_cached > 0 for r in cmp.cached.later_turns)
    assert cmp.cached.later_ttft_mean_s < cmp.uncached.later_ttft_mean_s
    assert cmp.cached.later_ttft_pct_s(50) < cmp.uncached.later_ttft_pct_s(50)


def test_a_turn_answered_from_another_conversation_is_caught(monkeypatch):
    monkeypatch.setattr(sim._Clients, "reference_of_prompt", lambda self, prompt: self.refs[0])
    with pytest.raises(RuntimeError, match="differs from its reference"):
        simulate_conversations(chunky(2), gen("iterative", 8), n_conversations=2, n_turns=2, n_user=8, n_first=70)


# ---- prompt speed: S stages against one process holding the whole model
def test_one_stage_decodes_its_chunks_one_after_another():
    st = StageCost([10.0, 11.0, 12.0, 13.0], 1.0, out_ms_per_row=0.25)
    t = one_stage_prompt_s(st, 2 * C + 10, C, head_overhead_ms=0.5)
    assert t == pytest.approx((2 * st.ms(C, 0) + st.ms(10, 1) + 0.5 * 4) / 1e3)


def test_prompt_speedup_on_balanced_stages(tmp_path):
    prof = load_profile(str(hand_profile(tmp_path)))
    free = Shape(n_layer=64, link=Link(0.0, 1e18))
    n = math.ceil(2000 / C)
    for s in (2, 4, 8):
        p = prompt_speedup(prof, s, 2000, free)
        # S stages of 1/S of the layers: S x chunks / (chunks + S - 1), less each stage's fixed cost per row
        assert 0.9 * s * n / (n + s - 1) < p.speedup <= s * n / (n + s - 1) * 1.001
        assert p.tokens_per_s == pytest.approx(p.speedup * p.one_stage_tokens_per_s)
    thin = prompt_speedup(prof, 8, 2000, replace(free, link=Link(1e-4, 1e5)))   # 100 kB/s: the links hold it back
    assert thin.speedup < prompt_speedup(prof, 8, 2000, free).speedup
    with pytest.raises(ValueError):
        prompt_speedup(prof, 1)


def test_prompt_speedup_of_the_70b_class_cluster_on_8_hosts():
    """A profile of 2 ranks x 1 thread of Qwen2.5-Coder-1.5B (tests/data/profile_2ranks.json, kept fixed: the one in
    results/ is re-measured with the benchmarks) scaled to a 70B-class model at Q4_K_M as launch/twin/twin_scaling.py scales it
    (80 layers, hidden 8192, per layer x18.3 and output projection x4.5 the profiled Qwen2.5-1.5B's by weight bytes),
    Gigabit links: a 2000-token prompt, 32 chunks, on 8 hosts is about 8 x 32 / 39 = 6.6 times one host's speed."""
    prof = load_profile(str(ROOT / "tests" / "data" / "profile_2ranks.json"))
    shape = Shape(n_layer=80, n_embd=8192, layer_scale=18.30, out_scale=4.50, link=Link(100e-6, 1e9 / 8))
    p = prompt_speedup(prof, 8, 2000, shape)
    assert 6.3 < p.speedup < 6.6
    assert 0.9 < p.one_stage_tokens_per_s < 1.4 and 6.0 < p.tokens_per_s < 9.0


# ---- the command
def test_plan_conversations_compares_the_cache_off_and_on(tmp_path):
    prof = hand_profile(tmp_path, slow=1.0)
    out = run_cli(["plan", "--profile", str(prof), "--agreement", "0.8", "-n", "16", "--n-prompt", "70",
                   "--conversations", "2", "--turns", "3", "--user-tokens", "20", "--think-s", "0.5"])
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "2 conversations of 3 turns" in lines[0] and "142 in the last turn's prompt" in lines[0]
    rows = lines[1:5]
    assert [ln.split()[0] for ln in rows] == ["interleaving"] * 2 + ["default"] * 2
    assert ["--cache-prompt off" in rows[0], "--cache-prompt on" in rows[1]] == [True, True]

    def ttft(line):
        return float(line.split("TTFT of turns 2+ p50")[1].split()[0])
    assert ttft(rows[1]) < ttft(rows[0]) and ttft(rows[3]) < ttft(rows[2])
    assert " 0.0% of prompt tokens cached" in rows[0] and " 0.0% of prompt" not in rows[1]
    both = run_cli(["plan", "--profile", str(prof), "--clients", "2", "--conversations", "2"])
    assert both.returncode != 0 and "not both" in both.stderr and "Traceback" not in both.stderr
