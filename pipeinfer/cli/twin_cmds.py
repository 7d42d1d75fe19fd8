"""`pipeinfer profile | simulate`: the digital twin's commands (pipeinfer.twin does the work; `plan` is
cli/plan_cmd.py).

profile:  measures the cluster the ranks run on (twin/profile.py) and writes one JSON file.
simulate: one generation of the real Head scheduler on a cluster described by a profile, optionally
          re-split, scaled to another model or to more hosts, with other links.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from ..core.results import append_result, stats_row
from ..engine.kernels import DEFAULT_KERNELS, KERNELS
from ..decide.genconfig import GenConfig
from ..twin.cluster import Link
from ..twin.plan import (
    Shape,
    build_cluster,
    load_profile,
    stage_table,
)
from ..twin.profile import ProfileOptions, run_profile
from ..twin.sim import simulate
from .guard import installed, run_guarded
from .options import speculation_options


def _gen_config(kw, mode: str) -> GenConfig:
    """The head's parameters from the speculation options (cli/options.SPECULATION_OPTIONS, as generate's)."""
    return GenConfig(mode=mode, n_predict=kw["n_predict"],
                     p_accept=kw["p_accept"], p_split=kw["p_split"], draft_max=kw["draft_max"] or 1,
                     max_branches=kw["max_branches"],
                     p_recovery=kw["p_recovery"], p_decay=kw["p_decay"], cancel=kw["cancel"],
                     continuous=kw["continuous"], draft_rides=kw["draft_rides"],
                     adaptive_draft=kw["micro_batch"] == "auto", stop_at_eos=False)


def _shape(kw) -> Shape:
    link = None
    if kw["bandwidth_mbit"] is not None or kw["latency_us"] is not None:
        link = Link((kw["latency_us"] if kw["latency_us"] is not None else 50.0) / 1e6,
                    (kw["bandwidth_mbit"] if kw["bandwidth_mbit"] is not None else 1000.0) * 1e6 / 8)
    fractions = None
    if kw["layer_split"]:
        from ..core.topology import parse_split
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
                 help="its cost per layer relative to the profiled model's (docs/twin.md)"),
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
@speculation_options
@click.option("--runner-up", default=0.0, show_default=True, type=click.FloatRange(0, 1),
              help="where the draft is wrong, the probability that its runner-up is the target's token (trees)")
@click.option("--replay-ref", default=None, help="take the target's tokens and the prompt from an earlier --json run")
@click.option("--seed", default=0, show_default=True, type=int, help="the draft's agreement draws (as --drafter replay)")
@click.option("--measured-draft", is_flag=True, help="the draft as the profile measured it (its confidence and agreement "
              "along the target's output), instead of --agreement: -pa then decides what it proposes")
@click.option("--results", default=None, help="append one CSV row (column simulated = twin)")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
def simulate_cmd(**kw) -> None:
    """Predict a generation's speed with the real scheduler on a simulated cluster (virtual time)."""
    prof = load_profile(kw["profile_path"])
    if kw["draft_max"] is None:  # the profile's exact batch limit (speculative: one less, for the lead token)
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
                   propose=kw["propose"], confidence=confidence, runner_up=kw["runner_up"])
    wall_s = time.perf_counter() - t0
    s = res.stats
    if kw["results"]:
        append_result(kw["results"], stats_row(
            s, mode=kw["mode"], target_model=prof["model"]["path"],
            draft_model="measured draft" if confidence else f"agreement {kw['agreement']:g}", ranks=cluster.n_ranks,
            layer_split="", prompt_name="twin", kernels=prof.get("kernels", ""), simulated="twin"))
    if kw["as_json"]:
        click.echo(json.dumps({"stats": s.to_dict(), "p_recovery": res.p_recovery, "wall_s": wall_s}))
        return
    draft = "the measured draft" if confidence else f"agreement {kw['agreement']:g}"
    click.echo(f"twin: {cluster.n_ranks} ranks, mode {kw['mode']}, {draft}, draft on "
               f"{cluster.draft_on}, {s.n_generated} tokens in {wall_s:.2f} s of simulation")
    click.echo(s.report())
    click.echo(stage_table(res))


@click.command("profile")
@click.option("-m", "--model", default=None, help="target GGUF path or registry name [default: qwen2.5-coder-1.5b]")
@click.option("--draft", default=None, help="draft GGUF to time [default: gemma3-270m when installed; 'none' to skip]")
@click.option("--ranks", default=None, type=click.IntRange(1, 256),
              help="stages to measure on this one process [default: the MPI ranks, or 2]")
@click.option("--layer-split", default=None, help="balanced, even or fractions of layers per rank, as `generate` "
              "[default: balanced]")
@click.option("-t", "--threads", default=None, help="threads per rank: one value or a,b,c [default: 1]")
@click.option("--max-batch", default=4, show_default=True, type=click.IntRange(1, 64), help="batch sizes timed: 1..this")
@click.option("--kernels", type=click.Choice(KERNELS), default=DEFAULT_KERNELS, show_default=True)
@click.option("-o", "--output", default="profile.json", show_default=True, help="where rank 0 writes the profile")
def profile_cmd(model, draft, ranks, layer_split, threads, max_batch, kernels, output) -> None:
    """Measure this cluster for the digital twin: stage costs by batch size, the draft, the links."""
    from ..engine.models import resolve_model

    def body(_kw) -> None:
        from mpi4py import MPI
        comm = MPI.COMM_WORLD
        if comm.Get_size() > 1 and ranks not in (None, comm.Get_size()):
            raise click.ClickException(f"--ranks {ranks} under {comm.Get_size()} MPI ranks: leave --ranks out")
        from ..engine.models import DEFAULT_TARGET
        target = resolve_model(model or DEFAULT_TARGET)
        dft = None if draft == "none" else (resolve_model(draft) if draft else installed("gemma3-270m"))
        opts = ProfileOptions(str(target), str(dft) if dft else None, ranks or max(2, comm.Get_size()), layer_split,
                              threads, max_batch, kernels)
        try:
            prof = run_profile(opts, comm if comm.Get_size() > 1 else None)
        except ValueError as e:
            from ..core.errors import UserError
            raise UserError(str(e)) from None
        if prof is not None:
            Path(output).write_text(json.dumps(prof, indent=1) + "\n")
            r = prof["ranks"]
            print(f"profile: {len(r)} stages, ms per 1-token decode " + ", ".join(f"{x['ms_by_batch'][0]:.1f}" for x in r)
                  + (f"; draft {prof['draft']['ms_per_token']:.1f} ms/token" if "draft" in prof else "")
                  + f"; exact batch limit {prof['exact_batch']}; written to {output}", flush=True)
    run_guarded(body, {})
