"""`pipeinfer simulate` and `pipeinfer plan`: predictions from the digital twin (twin.py).

simulate: one generation of the real Head scheduler on a cluster described by a profile (profile.py),
          optionally re-split, scaled to another model or to more hosts, with other links.
plan:     searches layer split, draft placement, micro-batch cap and -pr on a profile's cluster
          for the fastest simulated configuration, and prints the `pipeinfer launch` line that runs it
          beside the predicted tokens/s of iterative, speculative and pipeinfer.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path

import click

from .drafter import Cutoffs
from .head import MODES, GenConfig
from .twin import (Cluster, Link, SimResult, cluster_from_profile, draft_ms_per_proposal, scaled_layer_model, simulate,
                   speed_factor, stage_cost_from_model)

PLAN_P_RECOVERY = (None, 0.1, 0.25, 0.5)   # None: auto (0.5 / (ranks - 1))
PLAN_P_ACCEPT = (0.1, 0.3, 0.5, 0.7)


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
    from .topology import layer_ranges
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
    tokens_per_s: float = 0.0


def _splits(n_ranks: int, step: float = 0.05) -> list[list[float] | None]:
    """The even split (None) and fractions around it in `step`s (2-4 ranks; more: even only)."""
    out: list[list[float] | None] = [None]
    if n_ranks < 2 or n_ranks > 4:
        return out
    grid = [round(i * step, 4) for i in range(1, int(1 / step))]
    for head in itertools.product(grid, repeat=n_ranks - 1):
        rest = round(1.0 - sum(head), 4)
        if rest >= step - 1e-9:
            out.append(list(head) + [rest])
    return out


def search(prof: dict, *, agreement: float, n_predict: int, exact_limit: int, draft_own_host: bool,
           base: GenConfig, link: Link | None = None, propose: float = 1.0,
           confidence: list | None = None) -> dict[str, Candidate]:
    """The fastest simulated configuration of each mode (iterative: the split only). The draft: right with
    probability `agreement`, proposing at `propose` of its calls (a model draft below its cutoff proposes
    nothing, and costs its time), or, given the profile's measured `confidence` pairs, as they and the
    cutoff decide; then -pa is searched too."""
    n_ranks = len(prof["ranks"])
    best: dict[str, Candidate] = {}

    def run(cand: Candidate) -> float:
        gen = replace(base, mode=cand.mode, n_predict=n_predict, p_recovery=cand.p_recovery,
                      cut=replace(base.cut, n_max=cand.draft_max or 1, p_accept=cand.p_accept))
        cl = build_cluster(prof, Shape(fractions=cand.fractions, link=link, draft_on=cand.draft_on))
        return simulate(cl, gen, agreement=agreement, propose=propose, confidence=confidence).stats.gen_tokens_per_s

    splits = _splits(n_ranks)
    for fr in splits:  # the split first, on iterative (the split that balances stages)
        cand = Candidate("iterative", fr, "head", None, 0.5, 0.0)
        cand.tokens_per_s = run(cand)
        if "iterative" not in best or cand.tokens_per_s > best["iterative"].tokens_per_s:
            best["iterative"] = cand
    fr_splits = list({tuple(c) if c else None for c in [None, best["iterative"].fractions]})
    places = ["head", "own"] if draft_own_host else ["head"]
    for mode in ("speculative", "pipeinfer"):
        lead = mode == "speculative"
        caps = range(1, max(1, exact_limit - lead) + 1)
        p_recs = PLAN_P_RECOVERY if mode == "pipeinfer" else (0.0,)
        # -pa: searched where the draft's measured confidence says what a cutoff does to the acceptance; with a
        # draft that agrees with a fixed probability it stays the user's
        p_accepts = PLAN_P_ACCEPT if confidence else (base.cut.p_accept,)
        for fr, place, cap, pr, pa in itertools.product(fr_splits, places, caps, p_recs, p_accepts):
            cand = Candidate(mode, list(fr) if fr else None, place, cap, pa, pr)
            cand.tokens_per_s = run(cand)
            if mode not in best or cand.tokens_per_s > best[mode].tokens_per_s:
                best[mode] = cand
    return best


def launch_line(prof: dict, cand: Candidate, hostfile: str = "hosts.txt") -> str:
    parts = [f"pipeinfer launch --hostfile {hostfile} -- generate --mode {cand.mode}"]
    if cand.fractions:
        parts.append("--layer-split " + ",".join(f"{f:g}" for f in cand.fractions))
    threads = [r["threads"] for r in prof["ranks"]]
    parts.append("-t " + ",".join(map(str, threads)) if len(set(threads)) > 1 else f"-t {threads[0]}")
    if cand.mode != "iterative":
        parts += [f"--draft-max {cand.draft_max}", f"-pa {cand.p_accept:g}"]
        if cand.mode == "pipeinfer":
            parts.append(f"-pr {'auto' if cand.p_recovery is None else f'{cand.p_recovery:g}'}")
        # the twin's placements: in series on the head, or a host of its own (a hostfile line with role=draft)
        parts.append("--draft-at rank" if cand.draft_on == "own" else "--draft-at head")
    return " ".join(parts)


# ==================================================================== commands
def _gen_config(kw, mode: str) -> GenConfig:
    pr = kw["p_recovery"]
    return GenConfig(mode=mode, n_predict=kw["n_predict"],
                     cut=Cutoffs(kw["p_accept"], kw["p_split"], kw["draft_max"] or 1, 1),
                     p_recovery=None if pr == "auto" else float(pr), p_decay=kw["p_decay"],
                     cancel=kw["cancel"], continuous=kw["continuous"], stop_at_eos=False)


def _shape(kw) -> Shape:
    link = None
    if kw["bandwidth_mbit"] is not None or kw["latency_us"] is not None:
        link = Link((kw["latency_us"] if kw["latency_us"] is not None else 50.0) / 1e6,
                    (kw["bandwidth_mbit"] if kw["bandwidth_mbit"] is not None else 1000.0) * 1e6 / 8)
    fractions = None
    if kw["layer_split"]:
        from .topology import parse_split
        n = kw["hosts"] or None
        try:
            fractions = parse_split(kw["layer_split"], n or len(kw["layer_split"].split(",")))
        except ValueError as e:
            raise click.ClickException(str(e)) from None
    return Shape(kw["hosts"], fractions, kw["n_layer"], kw["n_embd"], kw["layer_scale"], kw["out_scale"], link,
                 kw["draft_on"], kw["draft_ms"])


CLUSTER_OPTIONS = [
    click.option("--profile", "profile_path", required=True, help="a profile JSON written by `pipeinfer profile`"),
    click.option("--hosts", default=None, type=click.IntRange(2, 1024),
                 help="simulate this many hosts like the profile's rank 0 [default: the profiled ranks]"),
    click.option("--layer-split", default=None, help="fractions of layers per rank [default: the profiled split]"),
    click.option("--n-layer", default=None, type=click.IntRange(1), help="layers of a model you do not have"),
    click.option("--n-embd", default=None, type=click.IntRange(1), help="hidden size of that model (activation bytes)"),
    click.option("--layer-scale", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True),
                 help="its cost per layer relative to the profiled model's (README: Digital twin)"),
    click.option("--out-scale", default=1.0, show_default=True, type=click.FloatRange(0, min_open=True),
                 help="its output projection's cost relative to the profiled model's"),
    click.option("--bandwidth-mbit", default=None, type=click.FloatRange(0, min_open=True),
                 help="every link's bandwidth [default: the profile's links]"),
    click.option("--latency-us", default=None, type=click.FloatRange(0), help="every link's one-way latency"),
    click.option("--draft-on", type=click.Choice(["head", "own"]), default="head", show_default=True,
                 help="the draft runs on the head's thread, or on a host of its own (drafting ahead)"),
    click.option("--draft-ms", default=None, type=click.FloatRange(0), help="draft cost per token [default: the profile's]"),
    click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(1)),
    click.option("--agreement", default=0.7, show_default=True, type=click.FloatRange(0, 1),
                 help="probability that each draft token is the target's"),
    click.option("--propose", default=1.0, show_default=True, type=click.FloatRange(0, 1),
                 help="probability that the draft proposes at all when asked (a model draft is not always confident)"),
]


def cluster_options(f):
    for option in reversed(CLUSTER_OPTIONS):
        f = option(f)
    return f


@click.command("simulate")
@cluster_options
@click.option("--mode", type=click.Choice(MODES), default="pipeinfer", show_default=True)
@click.option("--draft-max", default=None, type=click.IntRange(1, 64), help="draft tokens per micro-batch [default: the "
              "profile's exact batch limit; speculative: one less]")
@click.option("-pa", "--p-accept", default=0.5, show_default=True, type=click.FloatRange(0, 1))
@click.option("-ps", "--p-split", default=0.1, show_default=True, type=click.FloatRange(0, 1))
@click.option("-pr", "--p-recovery", default="auto", show_default=True)
@click.option("-pd", "--p-decay", default=0.0, show_default=True, type=click.FloatRange(0))
@click.option("--cancel/--no-cancel", default=True)
@click.option("--continuous/--no-continuous", default=True)
@click.option("--replay-ref", default=None, help="take the target's tokens and the prompt from an earlier --json run")
@click.option("--seed", default=0, show_default=True, type=int, help="the draft's agreement draws (as --drafter replay)")
@click.option("--measured-draft", is_flag=True, help="the draft as the profile measured it (its confidence and agreement "
              "along the target's output), instead of --agreement: -pa then decides what it proposes")
@click.option("--results", default=None, help="append one CSV row (column simulated = twin)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def simulate_cmd(**kw) -> None:
    """Predict a generation's speed with the real scheduler on a simulated cluster (virtual time)."""
    prof = load_profile(kw["profile_path"])
    if kw["p_recovery"] != "auto":
        try:
            float(kw["p_recovery"])
        except ValueError:
            raise click.BadParameter("a number or auto", param_hint="-pr") from None
    if kw["draft_max"] is None:
        kw["draft_max"] = max(1, prof.get("exact_batch", 3) - (kw["mode"] == "speculative"))
    shape = _shape(kw)
    try:
        cluster = build_cluster(prof, shape)
    except ValueError as e:   # a profile without what this cluster needs (links of a one-process profile)
        raise click.UsageError(str(e)) from None
    gen = _gen_config(kw, kw["mode"])
    ref, n_prompt = None, 64
    if kw["replay_ref"]:
        data = json.loads(Path(kw["replay_ref"]).read_text())
        ref = list(data["prompt_tokens"]) + list(data["tokens"])
        n_prompt = len(data["prompt_tokens"])
    t0 = time.perf_counter()
    confidence = None
    if kw["measured_draft"]:
        confidence = (prof.get("draft") or {}).get("confidence")
        if not confidence:
            raise click.UsageError("--measured-draft: the profile has no measured draft confidence "
                                   "(profile on 2 or more ranks with a draft)")
    res = simulate(cluster, gen, agreement=kw["agreement"], reference=ref, n_prompt=n_prompt, seed=kw["seed"],
                   propose=kw["propose"], confidence=confidence)
    wall_s = time.perf_counter() - t0
    s = res.stats
    if kw["results"]:
        from . import __version__
        from .results import append_result
        append_result(kw["results"], {
            "mode": kw["mode"], "target_model": prof["model"]["path"], "draft_model": "measured draft" if confidence else f"agreement {kw['agreement']:g}",
            "ranks": cluster.n_ranks, "layer_split": "", "prompt_name": "twin", "n_prompt_tokens": s.n_prompt,
            "n_generated": s.n_generated, "pp_tokens_per_s": round(s.pp_tokens_per_s, 3),
            "gen_tokens_per_s": round(s.gen_tokens_per_s, 3), "ttft_s": round(s.ttft_s, 4),
            "itl_mean_s": round(s.itl_s, 4), "acceptance_rate": round(s.acceptance_rate, 4), "n_runs": s.n_runs,
            "n_cancelled": s.n_cancelled, "version": __version__, "kernels": prof.get("kernels", ""),
            "bytes_per_token": [round(b) for b in s.bytes_per_token()], "simulated": "twin"})
    if kw["as_json"]:
        click.echo(json.dumps({"stats": s.to_dict(), "p_recovery": res.p_recovery, "wall_s": wall_s}))
        return
    draft = "the measured draft" if confidence else f"agreement {kw['agreement']:g}"
    click.echo(f"twin: {cluster.n_ranks} ranks, mode {kw['mode']}, {draft}, draft on "
               f"{cluster.draft_on}, {s.n_generated} tokens in {wall_s:.2f} s of simulation")
    click.echo(s.report())
    click.echo(stage_table(res))


@click.command("plan")
@click.option("--profile", "profile_path", required=True, help="a profile JSON written by `pipeinfer profile`")
@click.option("--agreement", default=None, type=click.FloatRange(0, 1),
              help="probability that each draft token is right [default: the profiled draft's measured confidence "
                   "and agreement, which lets plan choose -pa too; else 0.7]")
@click.option("--propose", default=1.0, show_default=True, type=click.FloatRange(0, 1),
              help="with --agreement: share of draft calls that propose anything (a run's statistics: speculative "
                   "runs / draft calls)")
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(1))
@click.option("--draft-host/--no-draft-host", default=False,
              help="consider a host of its own for the draft (the hostfile then needs one more line)")
@click.option("--hostfile", default="hosts.txt", show_default=True, help="the hostfile named in the printed command")
def plan_cmd(profile_path: str, agreement: float | None, propose: float, n_predict: int, draft_host: bool,
             hostfile: str) -> None:
    """Search the fastest configuration for a profiled cluster and print the command that runs it."""
    prof = load_profile(profile_path)
    limit = int(prof.get("exact_batch", 3))
    confidence = (prof.get("draft") or {}).get("confidence") if agreement is None else None
    t0 = time.perf_counter()
    try:
        best = search(prof, agreement=0.7 if agreement is None else agreement, n_predict=n_predict, exact_limit=limit,
                      draft_own_host=draft_host, base=GenConfig(stop_at_eos=False), propose=propose,
                      confidence=confidence)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    draft = (f"the profiled draft's measured confidence ({len(confidence)} positions)" if confidence else
             f"agreement {0.7 if agreement is None else agreement:g}, proposing at {propose:g} of calls")
    click.echo(f"plan: {len(prof['ranks'])} ranks, {draft}, {n_predict} tokens "
               f"({time.perf_counter() - t0:.1f} s of simulation)")
    for mode in MODES:
        c = best[mode]
        click.echo(f"  {mode:<12} {c.tokens_per_s:6.2f} tokens/s   {launch_line(prof, c, hostfile)}")
    win = max(best.values(), key=lambda c: c.tokens_per_s)
    click.echo(f"fastest: {win.mode}, {win.tokens_per_s:.2f} tokens/s predicted "
               f"({win.tokens_per_s / best['iterative'].tokens_per_s:.2f}x iterative)")
    click.echo(launch_line(prof, win, hostfile))
    if win.draft_on == "own":
        click.echo(f"note: the draft runs on a host of its own: give it a line '# pipeinfer: role=draft' in {hostfile}")
