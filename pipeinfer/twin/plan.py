"""`pipeinfer simulate` and `pipeinfer plan`: predictions from the digital twin (sim.py).

simulate: one generation of the real Head scheduler on a cluster described by a profile (profile.py),
          optionally re-split, scaled to another model or to more hosts, with other links.
plan:     searches layer split, draft placement, micro-batch cap and -pr on a profile's cluster
          for the fastest simulated configuration, and prints the `pipeinfer launch` line that runs it
          beside the predicted tokens/s of iterative, speculative and pipeinfer; with --clients, a server
          under that load instead (serve_load: throughput and latency of three schedules); with
          --conversations, multi-turn chat with the prompt cache off and on (chat_load). On described hosts, the
          stage ranks as tensor-parallel groups too (group_layout, group_search: a pipeline of groups in the twin,
          one group by one process's arithmetic; groups.py prices a group stage).
prompt_speedup: uncached prompt tokens/s of S stages against one process holding the whole model.
"""
from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, replace
from pathlib import Path

import click

from ..core.topology import layer_ranges
from ..engine.kernels import resolve_draft_max
from ..decide.genconfig import GenConfig
from .cluster import (
    Cluster,
    Link,
    cluster_from_profile,
    draft_ms_per_proposal,
    scaled_layer_model,
    speed_factor,
    stage_cost_from_model,
)
from .sim import (
    ClientsResult,
    PromptSpeed,
    SimResult,
    compare_prompt_cache,
    prompt_speed,
    simulate,
    simulate_clients,
)

PLAN_P_RECOVERY = (None, 0.1, 0.25, 0.5)   # None: auto (0.5 / (ranks - 1))
PLAN_P_ACCEPT = (0.1, 0.3, 0.5, 0.7)
REFERENCE_PROFILE = Path(__file__).with_name("reference_profile.json")  # plan --machines' default calibration
TIE = 0.005          # a configuration tried later must be this much faster to win (the even split, then simpler ones)
TREE_BRANCHES = 4                          # --max-branches plan tries beside the chain (1)


def names_runner_ups(confidence: list | None, runner_up: float) -> bool:
    """Whether the draft offers siblings: a runner-up probability, or measured confidence with runner-ups
    ([p, right, p2, right2] entries, p2 > 0)."""
    if confidence:
        return any(len(c) >= 4 and c[2] > 0 for c in confidence)
    return runner_up > 0


def load_profile(path: str) -> dict:
    try:
        prof = json.loads(Path(path).read_text())
        prof["ranks"][0]["ms_by_batch"], prof["layer_model"]["layer_ms"], prof["model"]["n_layer"]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise click.ClickException(f"--profile {path}: not a pipeinfer profile ({type(e).__name__}: {e})") from None
    return prof


@dataclass
class Shape:
    """Where a simulated cluster differs from the profiled one."""
    hosts: int | None = None          # hosts like the profile's rank 0 (None: the profiled ranks)
    fractions: list[float] | None = None
    n_layer: int | None = None        # a model with another layer count ...
    n_embd: int | None = None         # ... width ...
    layer_scale: float = 1.0          # ... and cost per layer / output projection relative to the profiled one
    out_scale: float = 1.0
    link: Link | None = None
    draft_on: str = "head"
    draft_ms: float | None = None     # draft cost per proposed token (default: the profile's, translated if so)


def build_cluster(prof: dict, shape: Shape) -> Cluster:
    from ..core.topology import layer_ranges
    if shape.hosts is None and shape.n_layer is None and shape.layer_scale == 1.0 and shape.out_scale == 1.0:
        c = cluster_from_profile(prof, fractions=shape.fractions, draft_on=shape.draft_on, link=shape.link)
    else:  # a cluster we do not have: every host like rank 0, the layer model scaled to the model
        n_hosts = shape.hosts or len(prof["ranks"])
        n_layer = shape.n_layer or prof["model"]["n_layer"]
        lm = scaled_layer_model(prof["layer_model"], shape.layer_scale, shape.out_scale)
        factor = speed_factor(prof["layer_model"], prof["ranks"][0])
        ranges = layer_ranges(n_layer, shape.fractions or [1.0] * n_hosts)
        stages = [stage_cost_from_model(lm, rr.n_layers, i == n_hosts - 1, factor) for i, rr in enumerate(ranges)]
        link = shape.link or Link()
        draft = prof.get("draft") or {}
        c = Cluster(stages, [link] * n_hosts, shape.n_embd or prof["model"]["n_embd"], draft_ms_per_proposal(prof),
                    draft.get("prefill_ms_per_token", 0.0), shape.draft_on, link, prof.get("head_overhead_ms", 0.3))
    if shape.draft_ms is not None:
        c.draft_ms_per_token = shape.draft_ms
    return c


def stage_table(res: SimResult) -> str:
    lines = []
    for s in res.stages:
        total = s["t_busy_s"] + s["t_idle_s"]
        lines.append(f"rank {s['rank']}: busy {s['t_busy_s']:.2f} s ({100 * s['t_busy_s'] / total if total else 0:.0f}%), "
                     f"idle {s['t_idle_s']:.2f} s, {s['n_decoded']} runs / {s['n_tokens']} tokens, cancelled "
                     f"{s['n_cancelled_before']} before start + {s['n_cancelled_mid']} mid-decode")
    return "\n".join(lines)


# ==================================================================== plan: search
@dataclass
class Candidate:
    mode: str
    fractions: list[float] | None
    draft_on: str
    draft_max: int | None
    p_accept: float
    p_recovery: float | None
    branches: int = 1
    tokens_per_s: float = 0.0


def _splits(n_ranks: int, step: float = 0.05) -> list[list[float] | None]:
    """The profiled split (None) and fractions in `step`s (2-4 ranks; more: the profiled only), the most even
    first (the search keeps the first of splits that tie)."""
    if n_ranks < 2 or n_ranks > 4:
        return [None]
    grid = [round(i * step, 4) for i in range(1, int(1 / step))]
    out = []
    for head in itertools.product(grid, repeat=n_ranks - 1):
        rest = round(1.0 - sum(head), 4)
        if rest >= step - 1e-9:
            out.append(list(head) + [rest])
    return [None, *sorted(out, key=lambda fr: max(fr) - min(fr))]


def search(prof: dict, *, agreement: float, n_predict: int, exact_limit: int, draft_own_host: bool,
           base: GenConfig, link: Link | None = None, propose: float = 1.0,
           confidence: list | None = None, runner_up: float = 0.0,
           places: tuple[str, ...] | None = None, split_ok=None) -> dict[str, Candidate]:
    """The fastest simulated configuration of each mode (iterative: the split only). The draft: right with
    probability `agreement`, proposing at `propose` of its calls (a model draft below its cutoff proposes
    nothing, and costs its time), its runner-up right in `runner_up` of its misses, or, given the profile's
    measured `confidence` pairs, as they and the cutoff decide; then -pa is searched too. Where the draft names
    runner-ups, PipeInfer is tried with token trees too (--max-branches TREE_BRANCHES). `places`: where the draft
    may run (default: the head, and a host of its own with draft_own_host); `split_ok(fractions)`: whether a
    split other than the profiled one fits the hosts (described hosts: their RAM)."""
    n_ranks = len(prof["ranks"])
    best: dict[str, Candidate] = {}

    def run(cand: Candidate) -> float:
        gen = replace(base, mode=cand.mode, n_predict=n_predict, p_recovery=cand.p_recovery,
                      draft_max=cand.draft_max or 1, p_accept=cand.p_accept, max_branches=cand.branches)
        cl = build_cluster(prof, Shape(fractions=cand.fractions, link=link, draft_on=cand.draft_on))
        return simulate(cl, gen, agreement=agreement, propose=propose, confidence=confidence,
                        runner_up=runner_up).stats.gen_tokens_per_s

    splits = [fr for fr in _splits(n_ranks) if fr is None or split_ok is None or split_ok(fr)]
    for fr in splits:  # the split first, on iterative (the split that balances stages)
        cand = Candidate("iterative", fr, "head", None, 0.5, 0.0)
        cand.tokens_per_s = run(cand)
        if "iterative" not in best or cand.tokens_per_s > best["iterative"].tokens_per_s * (1 + TIE):
            best["iterative"] = cand
    fr_splits = list({tuple(c) if c else None for c in [None, best["iterative"].fractions]})
    places = places or (("head", "own") if draft_own_host else ("head",))
    for mode in ("speculative", "pipeinfer"):
        lead = mode == "speculative"
        caps = range(1, max(1, exact_limit - lead) + 1)
        p_recs = PLAN_P_RECOVERY if mode == "pipeinfer" else (0.0,)
        # -pa: searched where the draft's measured confidence says what a cutoff does to the acceptance; with a
        # draft that agrees with a fixed probability it stays the user's
        p_accepts = PLAN_P_ACCEPT if confidence else (base.p_accept,)
        trees = (1, TREE_BRANCHES) if mode == "pipeinfer" and names_runner_ups(confidence, runner_up) else (1,)
        for fr, place, cap, pr, pa, br in itertools.product(fr_splits, places, caps, p_recs, p_accepts, trees):
            cand = Candidate(mode, list(fr) if fr else None, place, cap, pa, pr, br)
            cand.tokens_per_s = run(cand)
            if mode not in best or cand.tokens_per_s > best[mode].tokens_per_s * (1 + TIE):
                best[mode] = cand
    return best


def split_counts(prof: dict, fractions: list[float] | None) -> list[int]:
    """Layers of each stage rank in a configuration: `fractions` through core/topology.layer_ranges, as start-up
    applies --layer-split, or the profile's own split (None)."""
    if fractions is None:
        return [r["layers"][1] - r["layers"][0] for r in prof["ranks"]]
    return [rr.n_layers for rr in layer_ranges(prof["model"]["n_layer"], fractions)]


def split_option(counts: list[int]) -> str:
    """--layer-split as layer counts (40,26,14): fractions layer_ranges turns back into exactly those counts (each
    share n_layer x c / n_layer is the integer c, no remainder to round)."""
    return "--layer-split " + ",".join(map(str, counts))


def threads_option(threads: list[int]) -> str:
    return "-t " + (",".join(map(str, threads)) if len(set(threads)) > 1 else str(threads[0]))


def launch_line(prof: dict, cand: Candidate, hostfile: str = "hosts.txt", model: str | None = None,
                draft: str | None = None, n_ctx: int | None = None, draft_threads: int | None = None) -> str:
    """The command that runs `cand` as the twin priced it: the split (split_option) and the threads always
    explicit, -c where a context was sized (n_ctx), the draft's threads on a host of its own (draft_threads)."""
    parts = [f"pipeinfer launch --hostfile {hostfile} -- generate --mode {cand.mode}"]
    if model:
        parts.append(f"-m {model}")
    if draft and cand.mode != "iterative":
        parts.append(f"--draft {draft}")
    if len(prof["ranks"]) > 1:
        parts.append(split_option(split_counts(prof, cand.fractions)))
    parts.append(threads_option([r["threads"] for r in prof["ranks"]]))
    if n_ctx:
        parts.append(f"-c {n_ctx}")
    return " ".join(parts + _speculation_options(cand, draft_threads))


def _speculation_options(cand, draft_threads: int | None, p_accept: bool = True) -> list[str]:
    """A candidate's speculation options (none for iterative): draft size, cutoffs, branches, where the draft runs (the
    twin's placements: in series on the head, or a host of its own, a hostfile line with role=draft)."""
    if cand.mode == "iterative":
        return []
    parts = [f"--draft-max {cand.draft_max}"] + ([f"-pa {cand.p_accept:g}"] if p_accept else [])
    if cand.mode == "pipeinfer":
        parts.append(f"-pr {'auto' if cand.p_recovery is None else f'{cand.p_recovery:g}'}")
        if cand.branches > 1:
            parts.append(f"--max-branches {cand.branches}")
    parts.append("--draft-at rank" if cand.draft_on == "own" else "--draft-at head")
    if cand.draft_on == "own" and draft_threads:
        parts.append(f"--draft-threads {draft_threads}")
    return parts


# ==================================================================== plan --machines: hosts you describe
@dataclass
class Described:
    """A cluster described in a hostfile, with a target: the profile the twin runs on, and what it must hold."""
    profile: dict
    ranks: list          # machines.RankPlan
    fits: list           # machines.HostFit
    first_start_s: float
    target: object       # machines.Target
    calibration: object  # machines.Calibration
    n_ctx: int
    draft_bytes: float = 0.0
    latency_us: float = 100.0   # one-way latency between two hosts (machines.LAN_LATENCY_US unless described)

    def split_ok(self, fractions: list[float]) -> bool:
        """Whether another split of the stage ranks fits each one's RAM (plan's search tries such splits)."""
        from .machines import capacity_layers, context_seqs
        stages = [r for r in self.ranks if not r.draft]
        sharing = {r.machine.name: sum(s.machine.name == r.machine.name for s in stages) for r in stages}
        ranges = layer_ranges(self.target.n_layer, fractions)
        n_seq = context_seqs(self.target, len(stages))
        return all(rr.n_layers <= capacity_layers(r, self.target, self.n_ctx, sharing[r.machine.name], n_seq)
                   for r, rr in zip(stages, ranges))

    @property
    def problems(self) -> list[str]:
        return [p for f in self.fits for p in f.problems]

    @property
    def draft_rank(self):
        """The role=draft host's rank (machines.RankPlan), or None."""
        return next((r for r in self.ranks if r.draft), None)

    def priced(self, counts: list[int], with_draft: bool) -> "Priced":
        """The hosts holding `counts` layers per stage rank (a command's split): ranks, RAM and disk, first start;
        the draft, `with_draft`, on its role=draft host or beside rank 0."""
        from .machines import first_start_s, fit, with_counts
        ranks = with_counts(self.ranks, counts)
        draft = self.draft_bytes if with_draft else 0.0
        fits = fit(ranks, self.target, self.n_ctx, draft, draft_beside_head=self.draft_rank is None)
        return Priced(ranks, fits, first_start_s(ranks, self.target, draft))


@dataclass
class Priced:
    """What one command's split asks of the described hosts."""
    ranks: list          # machines.RankPlan, with their layers
    fits: list           # machines.HostFit
    first_start_s: float

    @property
    def problems(self) -> list[str]:
        return [p for f in self.fits for p in f.problems]

    def ram_line(self) -> str:
        """One line: each host's RAM need / has."""
        return "RAM need/has (GiB): " + ", ".join(f"{f.machine.name} {f.ram_gib:.1f}/{_gib(f.machine.mem_gib)}"
                                                 for f in self.fits)


def describe(hostfile: str, target, prof: dict, *, n_ctx: int, latency_us: float, draft_bytes: float) -> Described:
    """The described hosts of `hostfile` (wire.launcher's format with cores=, mem=, mem_bw=, disk=, link=,
    speed=) running `target` (machines.Target) with a draft of draft_bytes, priced by the host model calibrated
    on `prof`."""
    from ..wire.launcher import parse_hostfile
    from .machines import (
        Calibration,
        described_profile,
        first_start_s,
        fit,
        machines_from_hosts,
    )
    machines = machines_from_hosts(parse_hostfile(hostfile))
    cal = Calibration.of(prof)
    dprof, ranks = described_profile(machines, target, cal, prof, n_ctx=n_ctx, latency_us=latency_us,
                                     draft_bytes=draft_bytes)
    return Described(dprof, ranks, fit(ranks, target, n_ctx, draft_bytes), first_start_s(ranks, target, draft_bytes),
                     target, cal, n_ctx, draft_bytes, latency_us)


def _gib(described: float | None) -> str:
    """A host's described GiB, or ? where its hostfile line does not say."""
    return "?" if described is None else f"{described:g}"


def fit_table(d: Described, priced: Priced | None = None) -> str:
    """A line per rank: host, threads, layers, its decode of one row (the host model's); a line per host: RAM
    and disk (of `priced`, a command's split; None: the described split)."""
    ranks, fits = (priced.ranks, priced.fits) if priced else (d.ranks, d.fits)
    t, cal = d.target, d.calibration
    lines = [f"{'rank':<5}{'host':<16}{'threads':>8}  {'layers':<10}{'one row':>10}"]
    for r in ranks:
        what = "the draft" if r.draft else f"{r.layers[0]}-{r.layers[1]}" + (" +out" if r.last else "")
        n = r.layers[1] - r.layers[0]
        ms = "" if r.draft else f"{cal.stage_ms(r.machine, r.threads, t.active_stage_bytes(n, r.last), 1):8.1f} ms"
        lines.append(f"{r.rank:<5}{r.machine.name:<16}{r.threads:>8}  {what:<10}{ms:>10}")
    lines.append(f"{'host':<16}{'RAM need/has (GiB)':>22}{'disk need/has (GiB)':>22}")
    for f in fits:
        lines.append(f"{f.machine.name:<16}{f'{f.ram_gib:.1f} / {_gib(f.machine.mem_gib)}':>22}"
                     f"{f'{f.disk_gib:.1f} / {_gib(f.machine.disk_gib)}':>22}")
    return "\n".join(lines)


# ==================================================================== plan --clients: a server under load
@dataclass
class LoadRow:
    """One schedule of `pipeinfer serve` under the load, and how it fared."""
    label: str
    mode: str
    parallel: int
    result: ClientsResult


def serve_load(prof: dict, *, n_clients: int, n_parallel: int, n_predict: int, n_prompt: int, agreement: float,
               propose: float = 1.0, confidence: list | None = None, base: GenConfig = GenConfig(stop_at_eos=False),
               draft_on: str = "head", requests_per_client: int = 4, n_ctx: int | None = None) -> list[LoadRow]:
    """`n_clients` closed-loop clients on the profiled cluster, served three ways: one generation at a time with
    PipeInfer (--parallel 1: a request's fastest answer, the others queue), interleaving (iterative, n_parallel
    generations, nothing speculative) and the default (pipeinfer with n_parallel: interleaving, the generations'
    next tokens sharing decodes up to the profile's exact batch limit, the drafter lent where a stage would idle).
    PipeInfer's micro-batches are as start-up sizes them: --draft-max's default within the profile's exact batch
    limit. n_ctx: the stages' context (None: room for every slot's request at once)."""
    cluster = build_cluster(prof, Shape(draft_on=draft_on))
    cap = int(prof.get("exact_batch", 3))
    rows = []
    for label, mode, parallel in (("pipeinfer", "pipeinfer", 1), ("interleaving", "iterative", n_parallel),
                                  ("default", "pipeinfer", n_parallel)):
        gen = replace(base, mode=mode, n_predict=n_predict, p_recovery=None if mode == "pipeinfer" else 0.0,
                      draft_max=resolve_draft_max(None, cap, lead=False) if mode == "pipeinfer" else 1,
                      batch_rows=cap if label == "default" else 1)
        res = simulate_clients(cluster, gen, n_clients=n_clients, n_requests=max(4, requests_per_client * n_clients),
                               n_prompt=n_prompt, n_parallel=parallel, agreement=agreement, propose=propose,
                               confidence=confidence, n_ctx=n_ctx)
        rows.append(LoadRow(label, mode, parallel, res))
    return rows


def recommend_serving(prof: dict, *, n_clients: int, n_predict: int, n_prompt: int, agreement: float,
                      propose: float = 1.0, confidence: list | None = None, draft_on: str = "head",
                      requests_per_client: int = 4, n_ctx: int | None = None) -> LoadRow:
    """The default schedule's --parallel and --batch-rows for this load: --parallel from the stage count up to the
    clients (1, 2 and 4 per stage, and every client), --batch-rows from 1 to the exact batch limit (the most that
    keeps every answer what it is alone, which `auto` asks each host for); the fastest, ties (within TIE) to the
    lower p50 latency. n_ctx: the stages' context (None: room for every slot's request at once)."""
    from ..decide.batching import MAX_PARALLEL
    cluster = build_cluster(prof, Shape(draft_on=draft_on))
    n = len(prof["ranks"])
    cap = int(prof.get("exact_batch", 3))
    parallels = sorted({min(MAX_PARALLEL, p) for p in (n, 2 * n, 4 * n, n_clients) if p <= max(n, n_clients)})
    best: LoadRow | None = None
    for parallel, rows in itertools.product(parallels, sorted({1, cap})):
        gen = replace(GenConfig(stop_at_eos=False), mode="pipeinfer", n_predict=n_predict, p_recovery=None,
                      draft_max=resolve_draft_max(None, cap, lead=False), batch_rows=rows)
        res = simulate_clients(cluster, gen, n_clients=n_clients, n_requests=max(4, requests_per_client * n_clients),
                               n_prompt=n_prompt, n_parallel=parallel, agreement=agreement, propose=propose,
                               confidence=confidence, n_ctx=n_ctx)
        row = LoadRow("--batch-rows " + ("auto" if rows == cap > 1 else str(rows)), "pipeinfer", parallel, res)
        if best is None or res.tokens_per_s > best.result.tokens_per_s * (1 + TIE) or (
                res.tokens_per_s >= best.result.tokens_per_s * (1 - TIE)
                and res.p50_latency_s < best.result.p50_latency_s):
            best = row
    return best


def load_table(rows: list[LoadRow]) -> str:
    lines = []
    for row in rows:
        r = row.result
        lines.append(f"  {row.label:<13} --mode {row.mode:<9} --parallel {row.parallel:<3} {r.tokens_per_s:8.2f} tokens/s "
                     f"({100 * r.fraction_of_limit:5.1f}% of the limit)   latency p50 {r.p50_latency_s:7.2f} s, "
                     f"p95 {r.p95_latency_s:7.2f} s")
    return "\n".join(lines)


CTX_ROUND = 256  # -c as plan sizes it: rounded up to this


def load_cells(n_parallel: int, n_prompt: int, n_predict: int, n_stages: int) -> int:
    """-c that lets n_parallel requests of n_prompt + n_predict tokens run at once on every stage (the scheduler
    admits a request while its cells fit, kvplan.ContextBudget): their cells, a token each more (planner.cells_short)
    and a round of speculative runs (kvplan.cells_reserve, the partitions start-up plans by default), rounded up."""
    from ..core.config import DEFAULT_DRAFT_MAX
    from ..core.kvplan import cells_reserve, in_flight_limit, plan_partitions
    n_part = plan_partitions(1, in_flight_limit(None, n_stages))[0]
    cells = n_parallel * (n_prompt + n_predict + 1) + cells_reserve(n_part, DEFAULT_DRAFT_MAX)
    return -(-cells // CTX_ROUND) * CTX_ROUND


def parallel_within(n_ctx: int, n_prompt: int, n_predict: int, n_stages: int) -> int:
    """The most requests of n_prompt + n_predict tokens that run at once in a context of n_ctx (load_cells's
    inverse; at least 1)."""
    n = 1
    while load_cells(n + 1, n_prompt, n_predict, n_stages) <= n_ctx:
        n += 1
    return n


# ==================================================================== one host, and copies of it
@dataclass
class OneHost:
    """One described host holding the whole model as one process: its one-stream speed alone and with the draft
    beside it (synchronous speculation, `draft_max` tokens a round), and its throughput serving `rows` requests
    at once."""
    name: str
    threads: int
    ram_gib: float
    tokens_per_s: float
    spec_tokens_per_s: float
    draft_max: int
    serve_tokens_per_s: float = 0.0

    @property
    def best(self) -> tuple[str, float]:
        return max((("speculative", self.spec_tokens_per_s), ("iterative", self.tokens_per_s)), key=lambda m: m[1])


def speculative_tokens(agreement: float, k: int) -> float:
    """Tokens one round of synchronous speculation yields: the accepted prefix of k drafted tokens, each right with
    probability `agreement` independently, and the target's own next token: (1 - a^(k+1)) / (1 - a)."""
    a = min(agreement, 0.999999)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def one_hosts(d: Described, *, agreement: float, exact_limit: int, n_prompt: int = 64, n_predict: int = 128,
              clients: int = 1) -> list[OneHost]:
    """Each stage host that holds the whole model, its KV cache and the draft in its RAM, priced by the host model
    as one process on all its cores (the twin simulates 2 or more ranks, so this is the roofline's arithmetic):
    a token costs the whole model's one-row decode; speculation k draft tokens then k + 1 rows
    (speculative_tokens of them right), k up to the exact batch limit less the lead token; serving, a copy on each
    such host takes its share of `clients`: that many rows a decode (up to the limit), each request's prompt at
    the prompt rate."""
    from .machines import GIB
    t, cal = d.target, d.calibration
    ram = (t.rank_ram_bytes(t.n_layer, True, True, d.n_ctx) + d.draft_bytes) / GIB
    hosts = [m for m in dict.fromkeys(r.machine for r in d.ranks if not r.draft) if m.mem_gib is None or ram <= m.mem_gib]
    rows = max(1, min(-(-clients // max(1, len(hosts))), exact_limit))  # each copy's share of the clients
    active = t.active_stage_bytes(t.n_layer, True)
    out = []
    for m in hosts:
        threads = m.threads or max(1, m.cores)  # one process: every core of the host

        def ms(rows: int) -> float:
            return cal.stage_ms(m, threads, active, rows, t.read_stage_bytes(t.n_layer, True, rows))
        speeds = one_process(ms, cal.draft_ms(m, threads, d.draft_bytes), cal.head_overhead_ms, agreement=agreement,
                             exact_limit=exact_limit, n_prompt=n_prompt, n_predict=n_predict, rows=rows)
        out.append(OneHost(m.name, threads, ram, *speeds))
    return out


def one_process(ms, draft_ms: float, overhead_ms: float, *, agreement: float, exact_limit: int, n_prompt: int,
                n_predict: int, rows: int) -> tuple[float, float, int, float]:
    """A model run by one process (one host alone, or one tensor-parallel group: its leader's loop), from `ms(rows)`,
    a decode of that many rows (ms), the draft's ms per token beside it and the loop's overhead per decode:
    (tokens/s alone, tokens/s with synchronous speculation of k draft tokens a round, that k (up to the exact batch
    limit less the lead token), tokens/s serving requests of n_prompt + n_predict tokens `rows` at a time)."""
    def step(r: int) -> float:
        return ms(r) + overhead_ms
    spec = max((speculative_tokens(agreement, k) * 1e3 / (k * draft_ms + step(k + 1)), k)
               for k in range(1, max(1, exact_limit - 1) + 1))
    per_request_ms = n_prompt * step(64) / 64 + n_predict * step(rows) / rows  # of the process's time
    return 1e3 / step(1), spec[0], spec[1], n_predict * 1e3 / per_request_ms


def one_host_line(h: OneHost, model: str, draft: str | None, n_ctx: int, serve_parallel: int | None = None) -> str:
    """The command that runs the model on host h alone (one process: run it there, or through `launch` with a
    hostfile of that host's line): generate in its faster mode, or with serve_parallel a server."""
    mode, _ = h.best
    if serve_parallel:
        return f"pipeinfer serve -m {model} -t {h.threads} -c {n_ctx} --parallel {serve_parallel}"
    parts = [f"pipeinfer generate --mode {mode} -m {model}"]
    if mode == "speculative" and draft:
        parts += [f"--draft {draft}", f"--draft-max {h.draft_max}"]
    return " ".join(parts + [f"-t {h.threads}", f"-c {n_ctx}"])


def verdict(pipeline_tps: float, hosts: list[OneHost], what: str = "one stream") -> str:
    """One line: whether a pipeline is the tool for `what`, against the fastest host alone."""
    if not hosts:
        return "verdict: no host holds the model alone: a pipeline is how it runs here"
    best = max(hosts, key=lambda h: h.best[1])
    mode, tps = best.best
    if tps > pipeline_tps * (1 + TIE):
        return (f"verdict: a pipeline is the wrong tool here for {what}: {best.name} alone is {tps / pipeline_tps:.2f}x "
                f"faster ({tps:.2f} tokens/s, {mode})")
    return (f"verdict: the pipeline is {pipeline_tps / tps:.2f}x {best.name} alone ({tps:.2f} tokens/s, {mode}), "
            f"the fastest single host")


def replica_verdict(pipeline_tps: float, hosts: list[OneHost], clients: int) -> str:
    """One line: the pipeline under `clients` against a copy of the model on every host that holds it alone, the
    clients shared among the copies behind one endpoint (a load balancer in front of one `serve` per host)."""
    if not hosts:
        return "verdict: no host holds the model alone: a pipeline is how it serves here"
    total = sum(h.serve_tokens_per_s for h in hosts)
    copies = f"{hosts[0].name} alone" if len(hosts) == 1 else \
        f"{len(hosts)} copies of the model ({', '.join(h.name for h in hosts)}) behind one endpoint"
    if total > pipeline_tps * (1 + TIE):
        return (f"verdict: a pipeline is the wrong tool here for {clients} clients: {copies} would serve about "
                f"{total:.2f} tokens/s, {total / pipeline_tps:.2f}x")
    return f"verdict: the pipeline serves {pipeline_tps / total:.2f}x what {copies} would ({total:.2f} tokens/s)"


# ==================================================================== plan --conversations: multi-turn chat
@dataclass
class ChatRow:
    """One schedule of `pipeinfer serve` under a conversation workload, with the prompt cache off and on."""
    label: str
    mode: str
    parallel: int
    uncached: ClientsResult
    cached: ClientsResult


def chat_load(prof: dict, *, n_conversations: int, n_turns: int, n_user: int, n_first: int, n_parallel: int,
              n_predict: int, agreement: float, propose: float = 1.0, confidence: list | None = None,
              think_s: float = 0.0, base: GenConfig = GenConfig(stop_at_eos=False), draft_on: str = "head",
              n_ctx: int | None = None) -> list[ChatRow]:
    """`n_conversations` clients chatting for `n_turns` turns each (sim.simulate_conversations) on the profiled
    cluster, served by interleaving (iterative) and the default (pipeinfer), each with the prompt cache off and on
    in the same context (sim.compare_prompt_cache)."""
    cluster = build_cluster(prof, Shape(draft_on=draft_on))
    cap = int(prof.get("exact_batch", 3))
    rows = []
    for label, mode in (("interleaving", "iterative"), ("default", "pipeinfer")):
        gen = replace(base, mode=mode, n_predict=n_predict, p_recovery=None if mode == "pipeinfer" else 0.0,
                      draft_max=cap if mode == "pipeinfer" else 1)
        cmp = compare_prompt_cache(cluster, gen, n_parallel=n_parallel,
                                   n_ctx=n_ctx, n_conversations=n_conversations, n_turns=n_turns, n_user=n_user,
                                   n_first=n_first, think_s=think_s, agreement=agreement, propose=propose,
                                   confidence=confidence)
        rows.append(ChatRow(label, mode, n_parallel, cmp.uncached, cmp.cached))
    return rows


def chat_table(rows: list[ChatRow]) -> str:
    lines = []
    for row in rows:
        for cache, r in (("off", row.uncached), ("on", row.cached)):
            lines.append(f"  {row.label:<13} --mode {row.mode:<9} --parallel {row.parallel:<3} --cache-prompt {cache:<3} "
                         f"{r.tokens_per_s:8.2f} tokens/s   TTFT of turns 2+ p50 {r.later_ttft_pct_s(50):7.2f} s, "
                         f"p95 {r.later_ttft_pct_s(95):7.2f} s, mean {r.later_ttft_mean_s:7.2f} s   "
                         f"{100 * r.cached_share:4.1f}% of prompt tokens cached")
    return "\n".join(lines)


# ==================================================================== prompt processing: S stages against one
def prompt_speedup(prof: dict, n_stages: int, n_prompt: int = 2000, shape: Shape | None = None,
                   chunk: int | None = None) -> PromptSpeed:
    """Uncached prompt tokens/s of `n_stages` hosts like the profile's rank 0 (the layer model split evenly, scaled
    by `shape`: n_layer, layer_scale, out_scale, n_embd, link) against one such host holding the whole model, both
    decoding the prompt in chunks of `chunk` tokens (None: GenConfig.prompt_chunk). S stages: the twin (chunks
    flow through the stages one behind the other, the links carry each chunk's hidden states); one host: its
    chunks one after another (sim.one_stage_prompt_s). On balanced stages the ratio is about
    S x chunks / (chunks + S - 1), less what the links and the last stage's output projection add."""
    if n_stages < 2:
        raise ValueError("the twin simulates 2 or more stages")
    shape = shape or Shape()
    staged = build_cluster(prof, replace(shape, hosts=n_stages, fractions=None))
    one = build_cluster(prof, replace(shape, hosts=1, fractions=None))
    return prompt_speed(one, staged, n_prompt, chunk)


# ==================================================================== tensor-parallel groups (groups.py prices them)
@dataclass
class GroupLayout:
    """The described stage ranks as stages of tensor-parallel groups (`sizes`, in rank order): each stage's group,
    its layers, its one-row cost by part, and the profile the twin runs (None for one group: one stage, no pipeline)."""
    sizes: tuple[int, ...]
    groups: list            # groups.Group per stage
    counts: list[int]       # layers per stage
    costs: list             # groups.GroupCost per stage, one row
    profile: dict | None
    ram: list               # (machines.Machine, GiB needed) per host
    problems: list[str]
    wire: object = None     # groups.Wire: how the members talk (None: groups.PIPEINFER)

    @property
    def option(self) -> str:
        from .groups import layout_option
        return layout_option(list(self.sizes))

    @property
    def one_group(self) -> bool:
        return len(self.sizes) == 1

    def ram_line(self) -> str:
        return "RAM need/has (GiB): " + ", ".join(f"{m.name} {need:.1f}/{_gib(m.mem_gib)}" for m, need in self.ram)


def _stage_groups(d: Described, sizes: tuple[int, ...]) -> list:
    """The groups of the described stage ranks, consecutive in rank order (shares by the members' threads)."""
    from .groups import group_of
    stages = [r for r in d.ranks if not r.draft]
    out, i = [], 0
    for g in sizes:
        out.append(group_of([(r.machine, r.threads) for r in stages[i:i + g]], d.latency_us))
        i += g
    return out


def _group_capacity(d: Described, group, first: bool, last: bool, n_seq: int) -> int:
    """Layers a group can hold: each member its share of every layer (weights and KV cache) within its share of its
    host's RAM (no limit where RAM is not described); the leader of the first stage the token embeddings."""
    from .machines import GIB, RUNTIME_GIB
    t = d.target
    sharing: dict[str, int] = {}
    for r in d.ranks:
        if not r.draft:
            sharing[r.machine.name] = sharing.get(r.machine.name, 0) + 1
    cap = t.n_layer
    for k, m in enumerate(group.members):
        if m.machine.mem_gib is None:
            continue
        room = (m.machine.mem_gib * GIB / sharing.get(m.machine.name, 1) - RUNTIME_GIB * GIB
                - (t.embd_bytes if first and k == 0 else 0.0) - (m.share * t.out_bytes if last else 0.0))
        per_layer = m.share * (t.layer_bytes + t.cache_bytes_per_layer(d.n_ctx, n_seq))
        cap = min(cap, max(0, int(room // per_layer)))
    return cap


def _group_split(d: Described, groups: list, wire) -> list[int]:
    """Layers per group stage: the least time per token of the slowest stage (groups.group_stage_ms, one row), each
    within its members' RAM; binary search on that time, as machines.split_layers does for plain stages."""
    from .groups import group_stage_ms
    from .machines import context_seqs
    t, cal, n = d.target, d.calibration, len(groups)
    n_seq = context_seqs(t, n)
    caps = [_group_capacity(d, g, i == 0, i == n - 1, n_seq) for i, g in enumerate(groups)]
    if sum(caps) < t.n_layer:
        return caps

    def ms(i: int, layers: int) -> float:
        return group_stage_ms(groups[i], t, cal, layers, i == n - 1, wire=wire)

    def layers_within(t_ms: float) -> list[int]:
        out = []
        for i in range(n):
            lo, hi = 0, caps[i]          # the most layers whose stage takes at most t_ms (cost grows with layers)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if ms(i, mid) <= t_ms else (lo, mid - 1)
            out.append(lo)
        return out

    lo, hi = 0.0, max(ms(i, t.n_layer) for i in range(n))
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if sum(layers_within(mid)) < t.n_layer else (lo, mid)
    counts = layers_within(hi)
    extra = sum(counts) - t.n_layer
    for i in sorted(range(n), key=lambda i: -counts[i]):
        take = min(extra, counts[i] - 1)
        counts[i] -= take
        extra -= take
    return counts


def _group_ram(d: Described, groups: list, counts: list[int], with_draft: bool = True) -> tuple[list, list[str]]:
    """RAM each host needs for a layout (a member: its share of its stage's weights and KV cache, the first leader
    the embeddings, the draft beside the first leader or on its role=draft host, RUNTIME_GIB a rank), and the lines
    of what does not fit."""
    from .machines import GIB, RUNTIME_GIB, context_seqs
    t = d.target
    n_seq = context_seqs(t, len(groups))
    need: dict[str, list] = {}
    for i, (g, n) in enumerate(zip(groups, counts)):
        first, last = i == 0, i == len(groups) - 1
        for k, m in enumerate(g.members):
            layers = n * (t.layer_bytes + t.cache_bytes_per_layer(d.n_ctx, n_seq)) + (t.out_bytes if last else 0.0)
            b = (m.share * layers + (t.embd_bytes if first and k == 0 else 0.0) + RUNTIME_GIB * GIB
                 + (d.draft_bytes if with_draft and first and k == 0 and d.draft_rank is None else 0.0))
            need.setdefault(m.machine.name, [m.machine, 0.0])[1] += b / GIB
    dr = d.draft_rank
    if dr is not None and with_draft:
        need.setdefault(dr.machine.name, [dr.machine, 0.0])[1] += (d.draft_bytes + RUNTIME_GIB * GIB) / GIB
    ram = [(m, gib) for m, gib in need.values()]
    problems = [f"{m.name}: needs {gib:.1f} GiB of RAM, has {m.mem_gib:g}" for m, gib in ram
                if m.mem_gib is not None and gib > m.mem_gib]
    if sum(counts) < t.n_layer:
        problems.append(f"the hosts' RAM holds {sum(counts)} of the {t.n_layer} layers of {t.name}")
    return ram, problems


def group_layout(d: Described, sizes: tuple[int, ...], wire=None) -> GroupLayout:
    """The described cluster as stages of groups of `sizes` ranks, their members talking as `wire` (groups.Wire;
    None: pipeinfer's engine): split, costs, RAM, and (2 or more stages) the profile of that pipeline, each stage's
    record its group's costs (groups.py) and its links the leaders'."""
    from .groups import PIPEINFER, group_stage_cost
    from .machines import link_between
    wire = wire or PIPEINFER
    groups = _stage_groups(d, sizes)
    counts = _group_split(d, groups, wire)
    t, cal = d.target, d.calibration
    n = len(groups)
    costs = [group_stage_cost(g, t, cal, c, i == n - 1, wire=wire) for i, (g, c) in enumerate(zip(groups, counts))]
    ram, problems = _group_ram(d, groups, counts)
    prof = None
    if n >= 2 and not problems:
        b = len(cal.batch_ratio)
        records, start = [], 0
        for i, (g, c) in enumerate(zip(groups, counts)):
            last = i == n - 1
            ms = [group_stage_cost(g, t, cal, c, last, rows, wire).total_ms for rows in range(1, b + 1)]
            prompt = group_stage_cost(g, t, cal, c, last, 64, wire).total_ms / 64
            lead = g.leader.machine
            records.append({"rank": i, "host": lead.name, "machine": lead.name, "cores": lead.cores,
                            "threads": g.leader.threads, "layers": [start, start + c], "last": last,
                            "ms_by_batch": ms, "prompt_ms_per_token": prompt,
                            "group": [m.machine.name for m in g.members]})
            start += c
        links = [{"from": i, "to": (i + 1) % n, **link_between(groups[i].leader.machine,
                                                                groups[(i + 1) % n].leader.machine, d.latency_us)}
                 for i in range(n)]
        prof = {**d.profile, "ranks": records, "links": links}
    return GroupLayout(tuple(sizes), groups, counts, costs, prof, ram, problems, wire)


@dataclass
class GroupResult:
    """The fastest configuration of each mode on one layout: a Candidate per mode (the twin's search over a pipeline
    of groups; one group: synchronous speculation on its leader, one_process, whose pipeinfer is its speculative:
    one stage has nothing to overlap)."""
    layout: GroupLayout
    best: dict              # mode -> Candidate

    @property
    def win(self) -> Candidate:
        return max(self.best.values(), key=lambda c: c.tokens_per_s)


def group_search(d: Described, layout: GroupLayout, *, agreement: float, n_predict: int, exact_limit: int,
                 confidence: list | None, propose: float = 1.0, runner_up: float = 0.0) -> GroupResult:
    """Each mode's fastest configuration on a layout: 2 or more stages run in the twin (search, on the layout's own
    split: its stages priced as groups), one group by one_process's arithmetic on the group's cost."""
    from .groups import group_stage_ms
    if layout.profile is not None:
        places = ("own",) if d.draft_rank else ("head",)
        best = search(layout.profile, agreement=agreement, n_predict=n_predict, exact_limit=exact_limit,
                      draft_own_host=d.draft_rank is not None, base=GenConfig(stop_at_eos=False), propose=propose,
                      confidence=confidence, runner_up=runner_up, places=places, split_ok=lambda fr: False)
        return GroupResult(layout, best)
    g, t, cal = layout.groups[0], d.target, d.calibration
    lead = d.draft_rank or g.leader
    draft_ms = cal.draft_ms(lead.machine, lead.threads, d.draft_bytes)
    tps, spec, k, _ = one_process(lambda r: group_stage_ms(g, t, cal, t.n_layer, True, r, layout.wire), draft_ms,
                                  cal.head_overhead_ms, agreement=agreement, exact_limit=exact_limit, n_prompt=64,
                                  n_predict=n_predict, rows=1)
    place = "own" if d.draft_rank else "head"
    best = {"iterative": Candidate("iterative", None, "head", None, 0.5, 0.0, tokens_per_s=tps),
            "speculative": Candidate("speculative", None, place, k, 0.0, 0.0, tokens_per_s=spec)}
    return GroupResult(layout, best)


def group_serving(d: Described, layout: GroupLayout, *, n_clients: int, n_predict: int, n_prompt: int,
                  agreement: float, propose: float = 1.0, confidence: list | None = None) -> LoadRow | float:
    """A layout under n_clients closed-loop clients: 2 or more stages, the default schedule's best (recommend_serving,
    a LoadRow); one group, one process serving min(clients, exact limit) rows at a time (tokens/s, one_process)."""
    from .groups import group_stage_ms
    if layout.profile is not None:
        return recommend_serving(layout.profile, n_clients=n_clients, n_predict=n_predict, n_prompt=n_prompt,
                                 agreement=agreement, propose=propose, confidence=confidence,
                                 draft_on="own" if d.draft_rank else "head", n_ctx=d.n_ctx)
    g, t, cal = layout.groups[0], d.target, d.calibration
    rows = max(1, min(n_clients, d.calibration.exact_batch))
    return one_process(lambda r: group_stage_ms(g, t, cal, t.n_layer, True, r, layout.wire), 0.0, cal.head_overhead_ms,
                       agreement=agreement, exact_limit=cal.exact_batch, n_prompt=n_prompt, n_predict=n_predict,
                       rows=rows)[3]


def group_launch_line(layout: GroupLayout, cand: Candidate, hostfile: str, model: str | None, draft: str | None,
                      n_ctx: int | None, draft_threads: int | None = None) -> str:
    """The command that runs a layout as the twin priced it: the groups (--tensor-parallel G or --groups A,B,...),
    the stages' layers (--layer-split, one count a stage), every rank's threads, and the mode's settings."""
    parts = [f"pipeinfer launch --hostfile {hostfile} -- generate --mode {cand.mode}"]
    if model:
        parts.append(f"-m {model}")
    if draft and cand.mode != "iterative":
        parts.append(f"--draft {draft}")
    parts.append(layout.option)
    if len(layout.counts) > 1:
        parts.append(split_option(layout.counts))
    parts.append(threads_option([m.threads for g in layout.groups for m in g.members]))
    if n_ctx:
        parts.append(f"-c {n_ctx}")
    return " ".join(parts + _speculation_options(cand, draft_threads, p_accept=layout.profile is not None))


def group_serve_line(layout: GroupLayout, hostfile: str, model: str | None, draft: str | None, n_ctx: int,
                     rec: LoadRow | None, draft_threads: int | None = None) -> str:
    """The serve command of a layout under --clients (rec: the twin's recommended schedule; None for one group,
    which serves --parallel as one process does)."""
    parts = [f"pipeinfer launch --hostfile {hostfile} -- serve"]
    parts += [f"-m {model}"] if model else []
    parts += [f"--draft {draft}"] if draft else []
    parts.append(layout.option)
    if len(layout.counts) > 1:
        parts.append(split_option(layout.counts))
    parts.append(threads_option([m.threads for g in layout.groups for m in g.members]))
    parts += [f"--draft-threads {draft_threads}"] if draft_threads else []
    parts.append(f"-c {n_ctx}")
    if rec is not None:
        parts += [f"--parallel {rec.parallel}", rec.label]
    return " ".join(parts)
