"""`pipeinfer plan`: the fastest configuration the digital twin finds for a profiled cluster or for hosts you
describe (--machines), and the commands that run it: searches layer split, draft placement, micro-batch cap and -pr
and prints the `pipeinfer launch` line beside the predicted tokens/s of iterative, speculative and pipeinfer, what
each command's split asks of the hosts, and one host alone (and copies of it) beside the pipeline; with --clients N,
the throughput and latency of a server under N closed-loop clients instead, for three schedules, with -c sized for
the load; with --conversations N, N multi-turn chats (--turns, --user-tokens, --think-s) with the prompt cache off
and on, and the time to first token of turns 2+; with --machines, the stage hosts as tensor-parallel groups too (one
group of all, and mixes of groups and single ranks, pipelined), and their command where they win (pipeinfer.twin does
the work).
"""
from __future__ import annotations

import os
from pathlib import Path
import time
from dataclasses import dataclass

import click

from ..engine.kernels import DEFAULT_KERNELS
from ..decide.genconfig import MODES, GenConfig
from ..decide.batching import PARALLEL_PER_STAGE_BATCHED, default_parallel
from ..twin.machines import (
    GIB,
    LAN_LATENCY_US,
    N_CTX,
    NAMED_TARGETS,
    PROFILED_DRAFT_BYTES,
    named_target,
    target_from_gguf,
)
from ..twin.plan import (
    CTX_ROUND,
    REFERENCE_PROFILE,
    TIE,
    Shape,
    build_cluster,
    chat_load,
    chat_table,
    describe,
    fit_table,
    launch_line,
    load_cells,
    load_profile,
    load_table,
    one_host_line,
    one_hosts,
    parallel_within,
    recommend_serving,
    replica_verdict,
    search,
    serve_load,
    split_counts,
    split_option,
    threads_option,
    verdict,
)
from ..twin.sim import simulate


@click.command("plan")
@click.option("--profile", "profile_paths", multiple=True,
              help="a profile JSON written by `pipeinfer profile` [with --machines: the calibration shipped with "
                   "pipeinfer, measured on a 2-core AMD EPYC VM; give your own host's profile to calibrate on it]; "
                   "with --clients, one per --kernels setting to let plan choose the kernels too (repeat the option)")
@click.option("--machines", default=None, metavar="HOSTFILE",
              help="price hosts you describe instead of a profiled cluster: a hostfile whose '# pipeinfer:' comments "
                   "give cores=, mem= (GiB RAM), mem_bw= (GB/s), disk= (GiB free), link= (Mbit/s) and optionally speed= "
                   "(a core's speed relative to the profiled host's); prints what fits, the split and the command")
@click.option("-m", "--model", default=None,
              help="with --machines: the target GGUF (only its header is read) or a registry name")
@click.option("--model-size", type=click.Choice(sorted(NAMED_TARGETS)), default=None,
              help="with --machines: a target named by size, when you do not have its file yet")
@click.option("--draft", "draft_models", multiple=True,
              help="with --machines: the draft GGUF, for its size [default: the size of the target's usual draft "
                   "where --model-size names it, else the profiled draft's]; repeated, drafts of drafts (`generate "
                   "--draft A --draft B`): plan prices each depth and keeps the cheapest")
@click.option("--level-agreement", default=0.7, show_default=True, type=click.FloatRange(0, 1),
              help="with several --draft: how often each level agrees with the level above it (assumed)")
@click.option("--latency-us", default=LAN_LATENCY_US, show_default=True, type=click.FloatRange(0),
              help="with --machines: one-way latency between two hosts")
@click.option("--agreement", default=None, type=click.FloatRange(0, 1),
              help="probability that each draft token is right [default: the profiled draft's measured confidence "
                   "and agreement, which lets plan choose -pa too; else 0.7]")
@click.option("--propose", default=1.0, show_default=True, type=click.FloatRange(0, 1),
              help="with --agreement: share of draft calls that propose anything (a run's statistics: speculative "
                   "runs / draft calls)")
@click.option("-n", "--n-predict", default=128, show_default=True, type=click.IntRange(1))
@click.option("--runner-up", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="with --agreement: where the draft is wrong, the probability that its runner-up is right; above 0 "
                   "(or a profiled draft that names runner-ups) plan searches token trees (--max-branches) too")
@click.option("--draft-host/--no-draft-host", default=False,
              help="consider a host of its own for the draft (the hostfile then needs one more line)")
@click.option("--hostfile", default="hosts.txt", show_default=True, help="the hostfile named in the printed command")
@click.option("--clients", default=None, type=click.IntRange(1),
              help="instead of the search: a server under this many closed-loop clients (throughput, p50/p95 latency, "
                   "fraction of the stages' limit) with --parallel 1 PipeInfer, interleaving and the default")
@click.option("--parallel", default=None, type=click.IntRange(1),
              help=f"with --clients: generations at once [default: {PARALLEL_PER_STAGE_BATCHED} per stage, as serve]")
@click.option("--n-prompt", default=64, show_default=True, type=click.IntRange(1),
              help="with --clients: prompt tokens; with --conversations: the first turn's")
@click.option("--conversations", default=None, type=click.IntRange(1),
              help="instead of the search: this many multi-turn chats at once (a client each, waiting for every answer "
                   "before its next turn), served with the prompt cache off and on; -n is each answer's tokens")
@click.option("--turns", default=4, show_default=True, type=click.IntRange(1),
              help="with --conversations: turns of each; a turn's prompt is the one before, its answer and a new message")
@click.option("--user-tokens", default=32, show_default=True, type=click.IntRange(0),
              help="with --conversations: tokens of each new user message")
@click.option("--think-s", default=0.0, show_default=True, type=click.FloatRange(0),
              help="with --conversations: seconds a client waits after an answer before its next turn")
@click.option("--n-ctx", default=None, type=click.IntRange(1),
              help="with --conversations: the context's cells [default: room for every slot's longest turn]; with "
                   f"--machines: the KV cache each host sizes for [default: {N_CTX}]")
def plan_cmd(profile_paths: tuple[str, ...], machines: str | None, model: str | None, model_size: str | None,
             draft_models: tuple[str, ...], level_agreement: float, latency_us: float, agreement: float | None, propose: float, n_predict: int, runner_up: float,
             draft_host: bool, hostfile: str, clients: int | None, parallel: int | None, n_prompt: int,
             conversations: int | None, turns: int, user_tokens: int, think_s: float, n_ctx: int | None) -> None:
    """Search the fastest configuration for a profiled cluster, or for hosts you describe (--machines), and print
    the command that runs it."""
    if machines is None and not profile_paths:
        raise click.UsageError("give --profile (a profiled cluster) or --machines (hosts you describe)")
    if len(profile_paths) > 1:
        if clients is None or machines is not None:
            raise click.UsageError("several --profile (one per --kernels setting) go with --clients, without --machines")
        _plan_kernels(profile_paths, clients, parallel, n_predict, n_prompt, agreement, propose, draft_host, hostfile)
        return
    profile_path = profile_paths[0] if profile_paths else None
    if machines is None and (model or model_size):
        raise click.UsageError("-m and --model-size describe the target of --machines")
    prof = load_profile(profile_path or str(REFERENCE_PROFILE))
    if clients is not None and conversations is not None:
        raise click.UsageError("--clients or --conversations, not both (each conversation is a client)")
    if machines is not None:
        _plan_machines(prof, _Asked(machines, model, model_size, draft_models[0] if draft_models else None,
                                    draft_models[1:], level_agreement, latency_us, agreement, propose, n_predict,
                                    runner_up, hostfile, clients, parallel, n_prompt, n_ctx))
        return
    limit = int(prof.get("exact_batch", 3))
    confidence, parallel = _draft_and_parallel(prof, agreement, parallel)
    if conversations is not None:
        _plan_chat(prof, conversations, turns, user_tokens, n_prompt, parallel,
                   n_predict, 0.7 if agreement is None else agreement, propose, confidence, draft_host, think_s, n_ctx)
        return
    if clients is not None:
        cells = n_ctx or load_cells(clients, n_prompt, n_predict, len(prof["ranks"]))
        rec = _plan_clients(prof, clients, parallel, n_predict, n_prompt,
                            0.7 if agreement is None else agreement, propose, confidence, draft_host, cells)
        click.echo(f"run: {_serve_line(prof, rec, hostfile, None, None, cells)}")
        return
    best = _search(prof, agreement, n_predict, limit, draft_host, propose, None, None, confidence, runner_up)
    for mode in MODES:
        c = best[mode]
        click.echo(f"  {mode:<12} {c.tokens_per_s:6.2f} tokens/s   {launch_line(prof, c, hostfile)}")
    win = max(best.values(), key=lambda c: c.tokens_per_s)
    click.echo(f"fastest: {win.mode}, {win.tokens_per_s:.2f} tokens/s predicted "
               f"({win.tokens_per_s / best['iterative'].tokens_per_s:.2f}x iterative)")
    click.echo(launch_line(prof, win, hostfile))
    if win.draft_on == "own":
        click.echo(f"note: the draft runs on a host of its own: give it a line '# pipeinfer: role=draft' in {hostfile}")


@dataclass(frozen=True)
class _Asked:
    """What plan --machines was asked."""
    machines: str
    model: str | None
    model_size: str | None
    draft_model: str | None
    draft_below: tuple[str, ...]     # drafts of drafts: the levels under draft_model
    level_agreement: float
    latency_us: float
    agreement: float | None
    propose: float
    n_predict: int
    runner_up: float
    hostfile: str
    clients: int | None
    parallel: int | None
    n_prompt: int
    n_ctx: int | None

    @property
    def agreement_or_default(self) -> float:
        return 0.7 if self.agreement is None else self.agreement


def _search(prof: dict, agreement: float | None, n_predict: int, limit: int, draft_host: bool, propose: float,
            places, split_ok, confidence, runner_up: float) -> dict:
    """search(), its header line printed; a one-line error for what the twin cannot run."""
    t0 = time.perf_counter()
    try:
        best = search(prof, agreement=0.7 if agreement is None else agreement, n_predict=n_predict, exact_limit=limit,
                      draft_own_host=draft_host, base=GenConfig(stop_at_eos=False), propose=propose, places=places,
                      split_ok=split_ok, confidence=confidence, runner_up=runner_up)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    draft = (f"the profiled draft's measured confidence ({len(confidence)} positions)" if confidence else
             f"agreement {0.7 if agreement is None else agreement:g}, proposing at {propose:g} of calls")
    click.echo(f"plan: {len(prof['ranks'])} ranks, {draft}, {n_predict} tokens "
               f"({time.perf_counter() - t0:.1f} s of simulation)")
    return best


def _serve_line(prof: dict, rec, hostfile: str, model: str | None, draft: str | None, n_ctx: int,
                draft_threads: int | None = None) -> str:
    """The serve command of plan --clients: the split, threads and context the twin priced."""
    parts = [f"pipeinfer launch --hostfile {hostfile} -- serve"]
    parts += [f"-m {model}"] if model else []
    parts += [f"--draft {draft}"] if draft else []
    if len(prof["ranks"]) > 1:
        parts.append(split_option(split_counts(prof, None)))
    parts.append(threads_option([r["threads"] for r in prof["ranks"]]))
    parts += [f"--draft-threads {draft_threads}"] if draft_threads else []
    return " ".join(parts + [f"-c {n_ctx}", f"--parallel {rec.parallel}", rec.label])


def _plan_machines(prof: dict, a: _Asked) -> None:
    """plan --machines: what fits, then the search (or a server under --clients) on the described hosts, each
    printed command followed by what its split asks of the hosts, and one host alone (and copies of it) beside it."""
    d, target_path = _described(prof, a, a.n_ctx or N_CTX)
    draft_arg = a.draft_model or _usual_draft(a.model, a.model_size)
    hostfile = a.machines if a.hostfile == "hosts.txt" else a.hostfile
    draft_rank = d.draft_rank
    draft_threads = draft_rank.threads if draft_rank else None
    dprof, limit = d.profile, int(d.profile.get("exact_batch", 3))
    if a.draft_below:
        draft_arg = _choose_depth(a, dprof, d.draft_bytes)
    confidence, parallel = _draft_and_parallel(dprof, a.agreement, a.parallel)
    agreement = _mean_agreement(confidence) if confidence else a.agreement_or_default
    if a.clients is not None:
        if a.n_ctx is None:
            d = _context_for_load(prof, a, d, load_cells(a.clients, a.n_prompt, a.n_predict, len(dprof["ranks"])))
            dprof = d.profile
        if len(dprof["ranks"]) > 1:
            rec = _plan_clients(dprof, a.clients, parallel, a.n_predict, a.n_prompt, a.agreement_or_default, a.propose,
                                confidence, draft_rank is not None, d.n_ctx)
            _show_priced(d, d.priced(split_counts(dprof, None), True), "the serve command's hosts")
            click.echo(f"run: {_serve_line(dprof, rec, hostfile, target_path, draft_arg, d.n_ctx, draft_threads)}")
        hosts = one_hosts(d, agreement=agreement, exact_limit=limit, n_prompt=a.n_prompt, n_predict=a.n_predict,
                          clients=a.clients)
        if len(dprof["ranks"]) > 1:
            click.echo(replica_verdict(rec.result.tokens_per_s, hosts, a.clients))
        copies = max(1, len(hosts))
        _show_one_hosts(hosts, target_path, draft_arg, d.n_ctx,
                        parallel_within(d.n_ctx, a.n_prompt, a.n_predict, 1) if hosts else None)
        if len(hosts) > 1:
            click.echo(f"  (the {copies} copies: one `pipeinfer serve` per host behind a load balancer, each with "
                       f"about {-(-a.clients // copies)} of the clients)")
        if len(dprof["ranks"]) > 1:
            _serve_groups(d, a, _Shown(hostfile, target_path, draft_arg, draft_threads), rec.result.tokens_per_s,
                          confidence)
        return
    hosts = one_hosts(d, agreement=agreement, exact_limit=limit)
    if len(dprof["ranks"]) == 1:
        click.echo("verdict: one stage rank is no pipeline: run the model as one process (the twin's pipeline needs "
                   "2 or more ranks; priced by the host model):")
        _show_one_hosts(hosts, target_path, draft_arg, d.n_ctx)
        return
    places = ("own",) if draft_rank else ("head",)  # the hostfile decides: a role=draft host, or none
    best = _search(dprof, a.agreement, a.n_predict, limit, draft_rank is not None, a.propose, places, d.split_ok,
                   confidence, a.runner_up)
    for mode in MODES:
        c = best[mode]
        line = launch_line(dprof, c, hostfile, target_path, draft_arg, d.n_ctx, draft_threads)
        click.echo(f"  {mode:<12} {c.tokens_per_s:6.2f} tokens/s   {line}")
        click.echo(f"  {'':<12} {'':>6}           {d.priced(split_counts(dprof, c.fractions), mode != 'iterative').ram_line()}")
    win = max(best.values(), key=lambda c: c.tokens_per_s)
    click.echo(f"fastest: {win.mode}, {win.tokens_per_s:.2f} tokens/s predicted "
               f"({win.tokens_per_s / best['iterative'].tokens_per_s:.2f}x iterative)")
    ttft = _ttft_s(dprof, win, a.n_prompt)
    click.echo(f"time to first token: {ttft:.2f} s for a {a.n_prompt}-token prompt (--n-prompt)")
    _show_priced(d, d.priced(split_counts(dprof, win.fractions), win.mode != "iterative"), "the fastest command's hosts")
    click.echo(launch_line(dprof, win, hostfile, target_path, draft_arg, d.n_ctx, draft_threads))
    click.echo(verdict(win.tokens_per_s, hosts))
    _show_one_hosts(hosts, target_path, draft_arg, d.n_ctx)
    _plan_groups(d, a, _Shown(hostfile, target_path, draft_arg, draft_threads), win.tokens_per_s, hosts,
                 agreement, confidence, limit)


@dataclass(frozen=True)
class _Shown:
    """What the printed commands of plan --machines name."""
    hostfile: str
    model: str
    draft: str | None
    draft_threads: int | None


def _groups_header(d, what: str) -> None:
    from ..twin.groups import F32_BYTES, group_of
    stages = [r for r in d.ranks if not r.draft]
    link = group_of([(r.machine, r.threads) for r in stages], d.latency_us).link
    row_kb = (d.target.n_embd * F32_BYTES + 4) / 1e3
    click.echo(f"tensor-parallel groups{what} (a stage's layers split over its group's hosts, which exchange "
               f"{row_kb:.1f} kB of partial sums a row twice a layer; links of {link.latency_s * 1e6:g} us and "
               f"{link.bandwidth_Bps * 8 / 1e6:g} Mbit/s):")


def _layout_label(lay) -> str:
    if lay.one_group:
        return f"one group of {lay.sizes[0]}"
    return f"{len(lay.sizes)} stages ({','.join(map(str, lay.counts))} layers)"


def _cost_line(lay) -> str:
    """Each stage's one-row decode by part (groups.GroupCost)."""
    parts = [f"{'+'.join(m.machine.name for m in g.members)}: compute {c.compute_ms:.1f} + exchanges "
             f"{c.exchange_ms:.1f} + input {c.input_ms:.2f} + logits {c.gather_ms:.2f} = {c.total_ms:.1f} ms"
             for g, c in zip(lay.groups, lay.costs)]
    return "one row: " + "; ".join(parts)


def _plan_groups(d, a: _Asked, shown: _Shown, pipeline_tps: float, hosts: list, agreement: float,
                 confidence: list | None, limit: int) -> None:
    """plan --machines, one stream: the stage ranks as tensor-parallel groups (one group of all, and mixes of groups
    and single ranks, pipelined), each layout's modes priced (twin.plan.group_search), the fastest's command, and
    which design wins."""
    from ..twin.groups import layouts
    from ..twin.plan import group_launch_line, group_layout, group_search
    sizes_tried = layouts(sum(1 for r in d.ranks if not r.draft))
    if not sizes_tried:
        return
    t0 = time.perf_counter()
    results = []
    _groups_header(d, "")
    for sizes in sizes_tried:
        lay = group_layout(d, sizes)
        if lay.problems:
            click.echo(f"  {lay.option:<22} does not fit: {'; '.join(lay.problems)}")
            continue
        try:
            res = group_search(d, lay, agreement=agreement, n_predict=a.n_predict, exact_limit=limit,
                               confidence=confidence, propose=a.propose, runner_up=a.runner_up)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        results.append(res)
        speeds = []
        for mode in MODES:
            c = res.best.get(mode)
            speeds.append(f"{mode} {1e3 / c.tokens_per_s:6.1f} ms ({c.tokens_per_s:5.2f} tokens/s)" if c else
                          f"{mode} = speculative (one stage)")
        click.echo(f"  {lay.option:<22} {_layout_label(lay):<26} " + "   ".join(speeds))
    if not results:
        return
    best = max(results, key=lambda r: r.win.tokens_per_s)
    win, lay = best.win, best.layout
    alone = max((h.best[1] for h in hosts), default=0.0)
    other = max(pipeline_tps, alone)
    click.echo(f"fastest with groups: {lay.option}, {win.mode}: {win.tokens_per_s:.2f} tokens/s "
               f"({1e3 / win.tokens_per_s:.1f} ms per token), {win.tokens_per_s / pipeline_tps:.2f}x the fastest "
               f"pipeline ({pipeline_tps:.2f} tokens/s) ({time.perf_counter() - t0:.1f} s of simulation)")
    click.echo(f"  {_cost_line(lay)}")
    if win.tokens_per_s <= other * (1 + TIE):
        click.echo(f"verdict with groups: no layout of groups beats the best without them ({other:.2f} tokens/s; "
                   f"the fastest layout {win.tokens_per_s / other:.2f}x)")
        return
    click.echo(f"verdict with groups: {lay.option} ({_layout_label(lay)}, {win.mode}) is "
               f"{win.tokens_per_s / other:.2f}x the best without groups ({other:.2f} tokens/s)")
    click.echo("the groups' ranks:")
    click.echo(_group_table(lay))
    # the pipeline's command stays the one at a line's start, as a host alone's is indented
    line = group_launch_line(lay, win, shown.hostfile, shown.model, shown.draft, d.n_ctx, shown.draft_threads)
    click.echo(f"  with groups: {line}")


def _group_table(lay) -> str:
    """A line per rank of a layout: host, threads, its stage's layers, its share of them; then the RAM line."""
    lines = [f"{'rank':<5}{'host':<16}{'threads':>8}  {'layers':<12}{'share':>6}"]
    rank, start = 0, 0
    for i, (g, n) in enumerate(zip(lay.groups, lay.counts)):
        last = i == len(lay.groups) - 1
        for m in g.members:
            what = f"{start}-{start + n}" + (" +out" if last else "")
            lines.append(f"{rank:<5}{m.machine.name:<16}{m.threads:>8}  {what:<12}{m.share:>6.2f}")
            rank += 1
        start += n
    return "\n".join(lines + [f"  {lay.ram_line()}"])


def _serve_groups(d, a: _Asked, shown: _Shown, pipeline_tps: float, confidence: list | None) -> None:
    """plan --machines --clients: every stage a group of G ranks (G dividing the stage ranks; one group of all
    included) under the same load, a group a faster stage (twin.plan.group_serving), and the fastest's command."""
    from ..twin.groups import layouts
    from ..twin.plan import group_layout, group_serve_line, group_serving
    sizes_tried = [s for s in layouts(sum(1 for r in d.ranks if not r.draft)) if len(set(s)) == 1]
    if not sizes_tried:
        return
    _groups_header(d, f" under {a.clients} clients")
    best = None
    for sizes in sizes_tried:
        lay = group_layout(d, sizes)
        if lay.problems:
            click.echo(f"  {lay.option:<22} does not fit: {'; '.join(lay.problems)}")
            continue
        got = group_serving(d, lay, n_clients=a.clients, n_predict=a.n_predict, n_prompt=a.n_prompt,
                            agreement=a.agreement_or_default, propose=a.propose, confidence=confidence)
        if isinstance(got, float):
            tps, rec = got, None
            how = f"one process, {max(1, min(a.clients, d.calibration.exact_batch))} rows a decode"
        else:
            tps, rec = got.result.tokens_per_s, got
            how = (f"--parallel {rec.parallel} {rec.label}, latency p50 {rec.result.p50_latency_s:.2f} s, "
                   f"p95 {rec.result.p95_latency_s:.2f} s")
        click.echo(f"  {lay.option:<22} {_layout_label(lay):<26} {tps:8.2f} tokens/s ({how})")
        if best is None or tps > best[0] * (1 + TIE):
            best = (tps, lay, rec)
    if best is None:
        return
    tps, lay, rec = best
    click.echo(f"fastest with groups: {lay.option}, {tps:.2f} tokens/s under {a.clients} clients, "
               f"{tps / pipeline_tps:.2f}x the pipeline's recommended schedule ({pipeline_tps:.2f} tokens/s)")
    if tps <= pipeline_tps * (1 + TIE):
        click.echo("verdict with groups: no layout of groups serves this load faster than the pipeline")
        return
    click.echo(f"verdict with groups: {lay.option} serves {tps / pipeline_tps:.2f}x the pipeline")
    parallel = None if rec is not None else parallel_within(d.n_ctx, a.n_prompt, a.n_predict, 1)
    line = group_serve_line(lay, shown.hostfile, shown.model, shown.draft, d.n_ctx, rec, shown.draft_threads)
    click.echo(f"  with groups: {line}" + (f" --parallel {parallel}" if parallel else ""))


def _choose_depth(a: _Asked, dprof: dict, first_bytes: float) -> str:
    """plan --machines with several --draft: each depth of the hierarchy priced by the rule the real one follows
    (twin/levels.py), a level's one-row decode the first draft's on its host scaled by file bytes (the n-gram
    drafter: free; first_bytes: the first draft's file, as the hosts were described with it); the cheapest depth (the
    shallower on a tie) becomes the described draft's cost. Returns the --draft arguments of the chosen depth
    (`A --draft B`)."""
    from ..core.config import NGRAM_LEVEL
    from ..engine.models import resolve_model
    from ..twin.levels import Level, price
    names = (a.draft_model, *a.draft_below)
    ms0 = float(dprof["draft"]["ms_per_token"])
    levels = [Level(names[0], ms0, 1.0)]
    for name in a.draft_below:
        if name == NGRAM_LEVEL:
            levels.append(Level(name, 0.0, a.level_agreement))
            continue
        try:
            size = float(os.path.getsize(resolve_model(name)))
        except (OSError, KeyError, ValueError) as e:
            raise click.ClickException(f"--draft {name}: {e}") from None
        levels.append(Level(name, ms0 * size / first_bytes, a.level_agreement))
    priced = [price(levels[:depth]) for depth in range(1, len(levels) + 1)]
    best = min(range(len(priced)), key=lambda k: (round(priced[k].ms_per_token, 6), k))
    for k, p in enumerate(priced):
        chain = " <- ".join(Path(n).name for n in names[:k + 1])
        verify = f", verifying {'/'.join(map(str, p.verify))} of the level below at once" if p.verify else ""
        click.echo(f"drafts of drafts: {chain}: {p.ms_per_token:.1f} ms a draft token{verify}"
                   f"{'  (chosen)' if k == best else ''}")
    dprof["draft"]["ms_per_token"] = priced[best].ms_per_token
    return " --draft ".join(names[:best + 1])


def _mean_agreement(confidence: list) -> float:
    """The share of a measured draft's tokens that were right ([p, right, ...] entries)."""
    return sum(c[1] for c in confidence) / len(confidence)


def _show_priced(d, priced, label: str) -> None:
    click.echo(f"{label}:")
    click.echo(fit_table(d, priced))
    head = priced.ranks[0].machine
    sent = sum(f.disk_gib for f in priced.fits if f.machine.name != head.name) * GIB / 1e9
    click.echo(f"first start: {sent:.1f} GB leave {head.name} one host at a time: about {priced.first_start_s / 60:.1f} min")
    for p in priced.problems:
        click.echo(f"does not fit: {p}", err=True)


def _show_one_hosts(hosts: list, model: str, draft: str | None, n_ctx: int, serve_parallel: int | None = None) -> None:
    """A line per host that holds the model alone: its speeds and the command that runs it there."""
    for h in hosts:
        speed = (f"serving about {h.serve_tokens_per_s:.2f} tokens/s" if serve_parallel else
                 f"{h.tokens_per_s:.2f} tokens/s, {h.spec_tokens_per_s:.2f} with the draft beside it "
                 f"(--draft-max {h.draft_max})")
        click.echo(f"  {h.name} alone: {speed}; {h.ram_gib:.1f} GiB of RAM; on {h.name}: "
                   f"{one_host_line(h, model, draft, n_ctx, serve_parallel)}")


def _context_for_load(prof: dict, a: _Asked, d, want: int):
    """The described hosts with -c sized for the load (`want` cells), or, where their RAM does not hold that, the
    largest that fits (said in one line)."""
    fits = lambda n: _describe(prof, a, n)  # noqa: E731
    full = fits(want)
    if not full.problems:
        return full
    lo, hi = 0, want // CTX_ROUND   # multiples of CTX_ROUND: lo fits (or 0), hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if not fits(mid * CTX_ROUND).problems else (lo, mid)
    got = max(lo * CTX_ROUND, d.n_ctx if not d.problems else 0)
    n_stages = len(d.profile["ranks"])
    click.echo(f"the load does not fit: {a.clients} requests of {a.n_prompt} + {a.n_predict} tokens at once need -c "
               f"{want} on every stage, the hosts' RAM holds -c {got}: about "
               f"{parallel_within(got, a.n_prompt, a.n_predict, n_stages)} at once, the others wait")
    return fits(got) if got != d.n_ctx else d


def _describe(prof: dict, a: _Asked, n_ctx: int):
    target, _, draft_bytes = _target(prof, a)
    try:
        return describe(a.machines, target, prof, n_ctx=n_ctx, latency_us=a.latency_us, draft_bytes=draft_bytes)
    except OSError as e:
        raise click.ClickException(f"--machines {a.machines}: {e.strerror or e}") from None
    except ValueError as e:
        raise click.ClickException(str(e)) from None


def _target(prof: dict, a: _Asked):
    """(the target, the path the commands name, the draft's bytes) of plan --machines."""
    from ..engine.models import resolve_model
    if (a.model is None) == (a.model_size is None):
        raise click.UsageError("--machines needs the target: -m MODEL.gguf or --model-size SIZE (one of them)")
    if a.model is not None:
        try:
            target_path = str(resolve_model(a.model))
            target = target_from_gguf(target_path)
        except (OSError, KeyError, ValueError) as e:
            raise click.ClickException(f"-m {a.model}: cannot read its GGUF header ({e})") from None
    else:
        target = named_target(a.model_size)
        target_path = "MODEL.gguf"  # the command names the file the user will have
    draft_bytes = target.draft_bytes or float((prof.get("draft") or {}).get("file_bytes", PROFILED_DRAFT_BYTES))
    if a.draft_model is not None:
        try:
            draft_bytes = float(os.path.getsize(resolve_model(a.draft_model)))
        except (OSError, KeyError, ValueError) as e:
            raise click.ClickException(f"--draft {a.draft_model}: {e}") from None
    return target, target_path, draft_bytes


def _described(prof: dict, a: _Asked, n_ctx: int):
    """plan --machines: the described cluster (plan.Described) and the target's path (MODEL.gguf where named by
    size), after the target's line; what does not fit is printed with the described split's table (exit 1)."""
    target, target_path, _ = _target(prof, a)
    d = _describe(prof, a, n_ctx)
    cal = d.calibration
    click.echo(f"target: {target.name}, {target.arch}, {target.n_layer} layers, {target.file_bytes / 1e9:.1f} GB "
               f"({target.active_layer_bytes * target.n_layer / 1e9:.1f} GB read per token); host model calibrated "
               f"at {cal.bytes_per_ms_per_core / 1e6:.1f} GB/s per core, {100 * cal.bw_efficiency:.0f}% of mem_bw, "
               f"serial share {cal.serial_share:.2f}; -c {n_ctx}")
    if d.problems:
        click.echo(fit_table(d))
        for p in d.problems:
            click.echo(f"does not fit: {p}", err=True)
        raise click.ClickException(f"{target.name} does not fit on the hosts of {a.machines} "
                                   f"({len(d.problems)} problem{'s' * (len(d.problems) > 1)} above)")
    click.echo("fits: every host has the RAM and disk for its share")
    return d, target_path


def _usual_draft(model: str | None, model_size: str | None) -> str:
    """The draft a printed command names: the pairing of the target's tokenizer (engine/drafts.py), or of the
    family a size names."""
    from ..engine.drafts import Tokenizer, pairing_for, tokenizer_of
    from ..engine.models import resolve_model
    if model is not None:
        return pairing_for(tokenizer_of(resolve_model(model))).file
    t = named_target(model_size)
    return pairing_for(Tokenizer(t.arch, t.pre, t.n_vocab)).file


def _ttft_s(prof: dict, cand, n_prompt: int) -> float:
    """The twin's time to first token of one generation in the chosen configuration."""
    from dataclasses import replace
    gen = replace(GenConfig(stop_at_eos=False), mode=cand.mode, n_predict=8, draft_max=cand.draft_max or 1,
                  p_accept=cand.p_accept, p_recovery=cand.p_recovery)
    cl = build_cluster(prof, Shape(fractions=cand.fractions, draft_on=cand.draft_on))
    return simulate(cl, gen, n_prompt=n_prompt, agreement=0.7).stats.ttft_s


def _plan_clients(prof: dict, clients: int, parallel: int, n_predict: int, n_prompt: int, agreement: float,
                  propose: float, confidence: list | None, draft_host: bool, n_ctx: int | None = None):
    """plan --clients: the three schedules under the load, on the profiled cluster (its split and links), and the
    recommended --parallel and --batch-rows (returned: a LoadRow)."""
    t0 = time.perf_counter()
    draft_on = "own" if draft_host else "head"
    try:
        rows = serve_load(prof, n_clients=clients, n_parallel=parallel, n_predict=n_predict, n_prompt=n_prompt,
                          agreement=agreement, propose=propose, confidence=confidence, draft_on=draft_on, n_ctx=n_ctx)
        rec = recommend_serving(prof, n_clients=clients, n_predict=n_predict, n_prompt=n_prompt, agreement=agreement,
                                propose=propose, confidence=confidence, draft_on=draft_on, n_ctx=n_ctx)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    draft = (f"the profiled draft's measured confidence ({len(confidence)} positions)" if confidence else
             f"agreement {agreement:g}, proposing at {propose:g} of calls")
    res = rows[0].result
    click.echo(f"plan: {len(prof['ranks'])} ranks, {draft}; {clients} closed-loop clients, {len(res.requests)} requests "
               f"of {n_prompt} + {n_predict} tokens, " + (f"-c {n_ctx}" if n_ctx else "a context with room for all") +
               f" ({time.perf_counter() - t0:.1f} s of simulation)")
    click.echo(f"the stages' limit: {res.limit_tokens_per_s:.2f} tokens/s (every stage busy with single-token decodes)")
    click.echo(load_table(rows))
    r = rec.result
    click.echo(f"recommended: --parallel {rec.parallel} {rec.label}: {r.tokens_per_s:.2f} tokens/s, latency p50 "
               f"{r.p50_latency_s:.2f} s, p95 {r.p95_latency_s:.2f} s (auto: the exact batch limit each host measures, "
               f"{prof.get('exact_batch', 3)} on the profiled one: every answer stays what it is alone)")
    return rec


def _draft_and_parallel(prof: dict, agreement: float | None, parallel: int | None) -> tuple[list | None, int]:
    """The profiled draft's measured confidence (None when --agreement replaces it), and --parallel (serve's
    default when not given)."""
    confidence = (prof.get("draft") or {}).get("confidence") if agreement is None else None
    return confidence, parallel or default_parallel(len(prof["ranks"]), batching=True)


def _plan_kernels(paths: tuple[str, ...], clients: int, parallel: int | None, n_predict: int, n_prompt: int,
                  agreement: float | None, propose: float, draft_host: bool, hostfile: str) -> None:
    """plan --clients over profiles of one cluster under several --kernels settings: each setting's schedules, and
    the kernels, --parallel and --batch-rows that serve the load fastest."""
    profs = [load_profile(p) for p in paths]
    kernels = [p.get("kernels") or DEFAULT_KERNELS for p in profs]
    if len(set(kernels)) < len(kernels):
        raise click.UsageError(f"the profiles' kernels {kernels}: give one profile per --kernels setting")
    if len({(p["model"].get("path"), len(p["ranks"])) for p in profs}) > 1:
        raise click.UsageError("the profiles are of different models or rank counts: profile one cluster")
    best = []
    for prof, k in zip(profs, kernels):
        click.echo(f"--kernels {k} (exact batch limit {prof.get('exact_batch', 3)}):")
        confidence, n_parallel = _draft_and_parallel(prof, agreement, parallel)
        rec = _plan_clients(prof, clients, n_parallel, n_predict, n_prompt, 0.7 if agreement is None else agreement,
                            propose, confidence, draft_host)
        best.append((rec.result.tokens_per_s, k, rec))
    tps, k, rec = max(best, key=lambda b: b[0])
    others = ", ".join(f"{o:.2f} with --kernels {ok}" for o, ok, _ in best if ok != k)
    click.echo(f"fastest for {clients} clients: --kernels {k}, {tps:.2f} tokens/s ({others})")
    flag = "" if k == DEFAULT_KERNELS else f" --kernels {k}"
    click.echo(f"run: pipeinfer launch --hostfile {hostfile} -- serve{flag} --parallel {rec.parallel} {rec.label}")


def _plan_chat(prof: dict, conversations: int, turns: int, user_tokens: int, n_first: int, parallel: int,
               n_predict: int, agreement: float, propose: float, confidence: list | None, draft_host: bool,
               think_s: float, n_ctx: int | None) -> None:
    """plan --conversations: interleaving and the default schedule, each with the prompt cache off and on."""
    t0 = time.perf_counter()
    try:
        rows = chat_load(prof, n_conversations=conversations, n_turns=turns, n_user=user_tokens, n_first=n_first,
                         n_parallel=parallel, n_predict=n_predict, agreement=agreement, propose=propose,
                         confidence=confidence, think_s=think_s, draft_on="own" if draft_host else "head", n_ctx=n_ctx)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    draft = (f"the profiled draft's measured confidence ({len(confidence)} positions)" if confidence else
             f"agreement {agreement:g}, proposing at {propose:g} of calls")
    last = n_first + (turns - 1) * (n_predict + user_tokens)
    click.echo(f"plan: {len(prof['ranks'])} ranks, {draft}; {conversations} conversations of {turns} turns ({n_first} "
               f"prompt tokens first, then each answer of {n_predict} and {user_tokens} new tokens: {last} in the last "
               f"turn's prompt; {think_s:g} s to think) ({time.perf_counter() - t0:.1f} s of simulation)")
    click.echo(chat_table(rows))
