"""`pipeinfer profile`: measure what the digital twin (sim.py) needs, on the ranks that will run.

Each rank, one at a time (the measurements must not compete for cores or memory bandwidth), times its
own stage's decode for batch sizes 1..max_batch with a warm KV cache of `n_ctx_fill` positions, and a
prompt-sized batch. Rank 0 also times (a) probe stages of k and 2k layers without the vocabulary and
of k layers with it, which split a stage's cost into fixed + per-layer + output projection (so the
twin can price any layer split, or a larger model), (b) the draft model's cost per drafted token and
per prompt token, and (c) its own scheduling overhead per run. Neighbouring ranks ping-pong over MPI
(netprobe.py) for each link's latency and bandwidth. Last, a short real iterative generation times each
stage's decode inside the pipeline, and every rank's timings are scaled by inside / alone (calibrate).
The result is one JSON file.

Run on one process (`pipeinfer profile --ranks 2`), every stage of the split is measured here in turn
and the links are left out (the twin then uses whatever links you give it).
"""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.config import (
    DRAFT_HEAD_AUTO,
    Config,
    DraftOptions,
    ServingOptions,
    SpeculationOptions,
    StageOptions,
)
from ..core.cpus import affinity, physical_cores
from ..core.kvplan import plan_partitions
from ..engine.ggufheader import model_size
from .cluster import PROMPT_PROBE_ROWS

PROFILE_FORMAT = 1
N_CTX_FILL = 128       # KV positions already filled when a decode is timed (a short prompt's worth)
N_PROMPT_PROBE = PROMPT_PROBE_ROWS   # tokens in the prompt-sized probe batch (the twin interpolates to it)
N_REPEAT = 5           # timings per batch size; the median is kept
MAX_THREADS_TIMED = 8  # the thread scaling is timed at 1..min(this, the host's cores) threads
RUN_N_CTX, RUN_N_BATCH = 4096, 512   # engines are loaded as `pipeinfer generate` loads them by default


@dataclass
class ProfileOptions:
    model: str
    draft: str | None
    ranks: int                 # stages of the split (= MPI ranks when run under mpiexec)
    layer_split: str | None
    threads: str | None
    max_batch: int
    kernels: str
    probe_layers: int = 2


def _engine(path, *, embd_input: bool, last: bool, threads: int, kernels: str):
    """A stage engine loaded as a generation loads it (cache size and sequences change llama.cpp's buffers
    and its kernels' timings: a 208-cell, 1-sequence context measured ~10 ms faster per stage)."""
    from ..engine.stage import StageEngine
    return StageEngine(path, n_ctx=RUN_N_CTX, n_batch=RUN_N_BATCH, n_seq_max=plan_partitions(1, 8)[1],
                       n_threads=threads, n_threads_batch=threads, embd_input=embd_input, capture_hidden=not last,
                       kernels=kernels)


def measure_stage(path, *, embd_input: bool, last: bool, threads: int, max_batch: int, kernels: str,
                  exact: bool = False) -> dict:
    """ms_by_batch (1..max_batch) and prompt ms per token of one stage file (with `exact`: its exact batch
    limit too, kernels.py)."""
    from ..engine.kernels import exact_batch_limit, time_decodes
    with _engine(path, embd_input=embd_input, last=last, threads=threads, kernels=kernels) as eng:
        ms = time_decodes(eng, list(range(1, max_batch + 1)) + [N_PROMPT_PROBE], N_CTX_FILL, N_REPEAT)
        limit = exact_batch_limit(eng, path, kernels, threads, threads) if exact and kernels != "fast" else None
    out = {"ms_by_batch": [round(x, 3) for x in ms[:-1]], "prompt_ms_per_token": round(ms[-1] / N_PROMPT_PROBE, 4)}
    if exact:
        out["exact_batch"] = limit
    return out


def machine_id() -> str:
    """Which physical machine this rank runs on: the kernel's boot id (network namespaces, as in
    launch/cluster/netns-cluster.sh, give one machine several host names), else the host name."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        from ..wire.hosts import host_name
        return host_name()


def measure_shared_slowdown(comm, path, *, embd_input: bool, last: bool, threads: int, kernels: str,
                            window_s: float = 4.0) -> float:
    """How much slower this rank's 1-token decode is while every rank decodes (ranks on one machine share
    its cores and memory bandwidth; on separate machines this is ~1): the mean decode time while all ranks
    decode in a loop for the same window_s, over the median time alone (ranks in turn)."""
    from ..core.protocol import Batch, kv_ops, rm
    from ..engine.kernels import time_decodes
    from ..wire.transport import polite_barrier
    rng = np.random.default_rng(comm.Get_rank())
    with _engine(path, embd_input=embd_input, last=last, threads=threads, kernels=kernels) as eng:
        alone = None
        for r in range(comm.Get_size()):
            polite_barrier(comm)
            if comm.Get_rank() == r:
                alone = time_decodes(eng, [1], N_CTX_FILL, N_REPEAT)[0]
        polite_barrier(comm)
        def batch(pos0: int, n: int):
            b = Batch.chain(np.full(n, min(500, eng.n_vocab - 1), np.int32), pos0)
            return b, rng.standard_normal((n, eng.n_embd), dtype=np.float32) * 0.1 if eng.embd_input else None
        eng.decode(*batch(0, N_CTX_FILL))  # the same warm cache the timings alone had
        b, emb = batch(N_CTX_FILL, 1)
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < window_s:  # every rank at once, for the same window
            eng.decode(b, emb)
            eng.apply_kv_ops(kv_ops(rm(0, N_CTX_FILL, -1)))
            n += 1
        together = (time.perf_counter() - t0) * 1e3 / n
        eng.apply_kv_ops(kv_ops(rm(-1)))
        polite_barrier(comm)
    return together / alone


def measure_layer_model(model: str, n_layer: int, k: int, threads: int, max_batch: int, kernels: str) -> dict:
    """fixed + per-layer + output-projection costs by batch size, from probe stages of k, 2k and k+vocab
    layers (middle-stage inputs: hidden states in, hidden states out)."""
    from ..engine.stagefile import ensure_stage_file
    k = max(1, min(k, n_layer // 2))
    a = measure_stage(ensure_stage_file(model, 0, k, with_vocab=False), embd_input=True, last=False,
                      threads=threads, max_batch=max_batch, kernels=kernels)
    b = measure_stage(ensure_stage_file(model, 0, 2 * k, with_vocab=False), embd_input=True, last=False,
                      threads=threads, max_batch=max_batch, kernels=kernels)
    c = measure_stage(ensure_stage_file(model, n_layer - k, n_layer, with_vocab=True), embd_input=True, last=True,
                      threads=threads, max_batch=max_batch, kernels=kernels)
    layer = [max(0.0, (y - x) / k) for x, y in zip(a["ms_by_batch"], b["ms_by_batch"])]
    fixed = [max(0.0, x - k * l) for x, l in zip(a["ms_by_batch"], layer)]
    out = [max(0.0, z - x) for x, z in zip(a["ms_by_batch"], c["ms_by_batch"])]
    p_layer = max(0.0, (b["prompt_ms_per_token"] - a["prompt_ms_per_token"]) / k)
    return {"probe_layers": k, "fixed_ms": _r(fixed), "layer_ms": _r(layer), "out_ms": _r(out),
            "prompt_fixed_ms_per_token": round(max(0.0, a["prompt_ms_per_token"] - k * p_layer), 4),
            "prompt_layer_ms_per_token": round(p_layer, 4),
            "prompt_out_ms_per_token": round(max(0.0, c["prompt_ms_per_token"] - a["prompt_ms_per_token"]), 4)}


def measure_threads(model: str, n_layer: int, k: int, kernels: str, max_threads: int) -> list[float]:
    """One-row decode ms of the k-layer probe stage at 1..max_threads threads (how a host's decode speeds up
    with threads: machines.serial_share_from)."""
    from ..engine.kernels import time_decodes
    from ..engine.stagefile import ensure_stage_file
    path = ensure_stage_file(model, 0, max(1, min(k, n_layer // 2)), with_vocab=False)
    out = []
    for t in range(1, max_threads + 1):
        with _engine(path, embd_input=True, last=False, threads=t, kernels=kernels) as eng:
            out.append(round(time_decodes(eng, [1], N_CTX_FILL, N_REPEAT)[0], 3))
    return out


def weight_bytes(model: str | os.PathLike) -> tuple[float, float]:
    """(bytes one token reads per layer, bytes of the output projection) of a GGUF: what scales a profile to
    another model (`layer_scale`, `out_scale`). Mixture-of-experts layers count their active experts only
    (cluster.active_bytes_per_layer)."""
    from ..engine.ggufheader import read_header
    from ..engine.stagefile import read_info
    from .cluster import active_bytes_per_layer
    header = read_header(model)
    fields, tensors = header.fields, header.tensors
    arch, n_layer = fields["general.architecture"], read_info(model).n_layer
    per_layer = active_bytes_per_layer({n: t.nbytes for n, t in tensors.items()}, n_layer,
                                       int(fields.get(f"{arch}.expert_count", 0)),
                                       int(fields.get(f"{arch}.expert_used_count", 0)))
    out = tensors.get("output.weight") or tensors["token_embd.weight"]
    return per_layer, out.nbytes


def _r(xs: list[float]) -> list[float]:
    return [round(x, 3) for x in xs]


def measure_draft(path, threads: int, kernels: str, n_max: int = 4, target: str | None = None,
                  head_tokens: int | None = DRAFT_HEAD_AUTO) -> dict:
    """The draft model's ms per drafted token (continuing its own chain, as continuous speculation does)
    and per prompt token; with the target's GGUF, and a draft of another vocabulary, the translating
    drafter's cost too (measure_translating)."""
    from ..drafters.drafter import Cutoffs, ModelDrafter
    d = ModelDrafter(path, n_ctx=RUN_N_CTX, max_branches=1, n_threads=threads, n_threads_batch=threads, kernels=kernels,
                     head_tokens=head_tokens)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, d.n_vocab, N_CTX_FILL).tolist()
    t0 = time.perf_counter()
    d.prefill(prompt)
    prefill_ms = (time.perf_counter() - t0) * 1e3
    ctx, per_token = list(prompt), []
    cut = Cutoffs(0.0, 1.0, n_max, 1)
    for _ in range(N_REPEAT + 1):
        t0 = time.perf_counter()
        tree = d.draft(ctx, cut)
        per_token.append((time.perf_counter() - t0) * 1e3 / max(1, len(tree)))
        ctx += [n.token for n in tree]
    out = {"model": os.path.basename(str(path)), "head_tokens": head_tokens if d.keep is not None else d.n_vocab,
           "ms_per_token": round(statistics.median(per_token[1:]), 3),
           "prefill_ms_per_token": round(prefill_ms / len(prompt), 4)}
    if target is not None:
        from ..drafters.factory import translates
        if translates(target, str(path)):   # another vocabulary: the draft runs translated, at another cost
            out["translating"] = measure_translating(d, target, str(path))
    d.engine.close()
    return out


TRANSLATE_TEXT = "Write a Python function that checks whether a number is prime, with a docstring and tests."
N_TRANSLATED = 48      # target tokens proposed while the translating drafter's cost is timed


def measure_translating(d, target: str, draft: str) -> dict:
    """A draft with another vocabulary than the target's, drafting ahead along its own chain as it does
    beside the pipeline (ahead_chunk draft tokens per call, no cutoff): ms per proposed target token,
    proposals per call and draft decodes per proposal (re-tokenizing, translation and the tokens whose
    boundary the look-ahead could not settle included)."""
    from ..engine.tokenizer import Tokenizer
    from ..drafters.drafter import Cutoffs
    from ..drafters.translating import TranslatingDrafter
    tt = Tokenizer(target)
    prompt = tt.encode(TRANSLATE_TEXT, add_special=True, parse_special=False)
    td = TranslatingDrafter(d, tt, Tokenizer(draft), n_prompt=len(prompt), prompt_text=TRANSLATE_TEXT, chat=True)
    td.prefill(prompt)
    ctx, n_calls, n_dec0 = list(prompt), 0, d.n_decodes
    nudge = tt.encode(" and", add_special=False, parse_special=False)
    t0 = time.perf_counter()
    while len(ctx) - len(prompt) < N_TRANSLATED and n_calls < 4 * N_TRANSLATED:
        tree = td.draft(ctx, Cutoffs(0.0, 1.0, TranslatingDrafter.ahead_chunk, 1))
        n_calls += 1
        ctx += [n.token for n in tree] or nudge   # nothing proposed (a boundary it cannot settle): move on
    ms = (time.perf_counter() - t0) * 1e3
    n_prop = max(1, td.n_proposed)
    return {"ms_per_proposal": round(ms / n_prop, 3), "proposals_per_call": round(td.n_proposed / max(1, n_calls), 3),
            "decodes_per_proposal": round((d.n_decodes - n_dec0) / n_prop, 3)}


def measure_head_overhead_ms() -> float:
    """The head's scheduling per launch or result: the real Head on a twin whose compute costs nothing,
    timed in wall-clock (the twin's own bookkeeping included, so a slight overestimate)."""
    from ..decide.genconfig import GenConfig
    from .cluster import Cluster, Link, StageCost
    from .sim import simulate
    zero = Cluster([StageCost([0.0] * 4, 0.0)] * 2, [Link(0.0, 1e15)] * 2, 1536)
    gen = GenConfig(mode="pipeinfer", n_predict=128, draft_max=3, p_recovery=0.5)
    t0 = time.perf_counter()
    res = simulate(zero, gen, agreement=0.7)
    wall_ms = (time.perf_counter() - t0) * 1e3
    return round(wall_ms / max(1, 2 * res.stats.n_runs), 4)


N_CALIBRATION_TOKENS = 32


def _iterative(opts: ProfileOptions, n_predict: int) -> Config:
    """A short iterative generation on the profiled layout, to the length asked (no stop at end of sequence)."""
    return Config(opts.model, mode="iterative",
                  stage=StageOptions(layer_split=opts.layer_split, threads=opts.threads, kernels=opts.kernels),
                  speculation=SpeculationOptions(p_recovery=0.0),
                  serving=ServingOptions(n_predict=n_predict, stop_at_eos=False))


def measure_in_pipeline(comm, opts: ProfileOptions, n_vocab: int) -> dict | None:
    """Each stage's 1-token decode time inside a short real iterative generation (rank 0 gets a dict:
    ms per stage rank >= 1 from its statistics, and the generation's ITL; None elsewhere)."""
    from ..ranks.startup import run
    res = run(_iterative(opts, N_CALIBRATION_TOKENS), [min(9707, n_vocab - 1)], comm)
    if res is None:
        return None
    st = res.stats.stage_stats
    return {"itl_ms": res.stats.itl_s * 1e3,
            "stage_ms": {s["rank"]: s["t_busy_s"] * 1e3 / max(1, s["n_decoded"]) for s in st[1:]}}


N_CONFIDENCE_TOKENS = 64   # target tokens the draft's confidence is read along


def workload_prompt() -> str:
    """The user prompt the profile reads the draft's confidence on: prompts/code.txt (the benchmarks' code
    prompt) in a source checkout, else TRANSLATE_TEXT."""
    from ..core.files import prompt_path, read_prompt_file
    try:
        text, _ = read_prompt_file(prompt_path("code"))
    except OSError:
        text = ""
    return text if text.strip() else TRANSLATE_TEXT


def target_output(comm, opts: ProfileOptions, text: str) -> tuple[list[int], list[int]] | None:
    """The target's own greedy continuation of `text` (chat format), through the real pipeline: rank 0 gets
    (prompt tokens, N_CONFIDENCE_TOKENS generated tokens), other ranks None."""
    from ..engine.tokenizer import Tokenizer, apply_chat
    from ..ranks.startup import run
    tok = Tokenizer(opts.model)
    prompt = tok.encode(apply_chat(tok, text))
    res = run(_iterative(opts, N_CONFIDENCE_TOKENS), prompt, comm)
    return None if res is None else (prompt, list(res.tokens))


def measure_confidence(draft: str, target: str, prompt: list[int], text: str, tokens: list[int], threads: int,
                       kernels: str, head_tokens: int | None = DRAFT_HEAD_AUTO) -> list[list[float]]:
    """Along the target's own output, at each position: the draft's confidence in its first proposal there
    and whether that proposal is the target's token ([p, 1 or 0]; [0, 0] where it proposes nothing), and where the
    draft names a runner-up (a draft of the target's vocabulary; the translating drafter names none), its
    probability and whether it is the target's token ([p, right, p2, right2]). The twin draws from these, so a
    cutoff (-pa) decides what is proposed and how much of it is right, and -ps which runner-ups could be siblings."""
    from ..drafters.drafter import Cutoffs
    from ..drafters.factory import make_drafter
    options = DraftOptions(model=draft, drafter="model", head_tokens=head_tokens)
    drafter_for = make_drafter(options, target=target, mode="pipeinfer", n_ctx=RUN_N_CTX, kernels=kernels,
                               max_branches=1, seed=0, n_vocab=0, n_threads=threads, n_threads_batch=threads)
    drafter = drafter_for(prompt, text, True)   # the same drafter, or translating through text (chat format)
    drafter.prefill(prompt)
    n_max = drafter.ahead_chunk
    seq, pairs = list(prompt) + list(tokens), []
    for i in range(len(prompt), len(seq)):
        tree = drafter.draft(seq[:i], Cutoffs(0.0, 1.0, n_max, 1))
        if not tree:
            pairs.append([0.0, 0])
            continue
        pairs.append([round(tree[0].prob, 4), int(tree[0].token == seq[i])])
        if tree[0].alt >= 0:
            pairs[-1] += [round(tree[0].alt_prob, 4), int(tree[0].alt == seq[i])]
    drafter.close()
    return pairs


def calibrate(records: dict[int, dict], in_pipeline: dict) -> None:
    """Scale each rank's timings by its decode time inside the pipeline over its time alone (inside, the
    same 1-token decodes measured 20-35% slower on this project's machine; rank 0's in-pipeline time is the
    ITL less the other stages'). Keeps the raw timings and the factor."""
    inside = dict(in_pipeline["stage_ms"])
    inside[0] = max(0.5 * records[0]["ms_by_batch"][0], in_pipeline["itl_ms"] - sum(inside.values()))
    for r, rec in records.items():
        f = inside[r] / rec["ms_by_batch"][0]
        rec["alone_ms_by_batch"], rec["alone_prompt_ms_per_token"] = rec["ms_by_batch"], rec["prompt_ms_per_token"]
        rec["ms_by_batch"] = [round(x * f, 3) for x in rec["ms_by_batch"]]
        rec["prompt_ms_per_token"] = round(rec["prompt_ms_per_token"] * f, 4)
        rec["in_pipeline_factor"] = round(f, 3)


def measure_on_head(opts: ProfileOptions, n_layer: int, threads: int) -> dict:
    """What is measured on the head's host only: the layer model, the thread scaling, the draft, the head's
    overhead."""
    from ..engine.kernels import draft_kernels
    from .machines import serial_share_from
    extra: dict = {"layer_model": measure_layer_model(opts.model, n_layer, opts.probe_layers, threads,
                                                      opts.max_batch, opts.kernels)}
    extra["ms_by_threads"] = measure_threads(opts.model, n_layer, opts.probe_layers, opts.kernels,
                                             min(MAX_THREADS_TIMED, physical_cores(affinity())))
    extra["serial_share"] = round(serial_share_from(extra["ms_by_threads"]), 4)
    if opts.draft:
        # as serve loads it beside these stages (repacked beside tiled ones)
        extra["draft"] = measure_draft(opts.draft, threads, draft_kernels(opts.kernels), target=opts.model)
        extra["draft"]["file_bytes"] = model_size(opts.draft)
    extra["head_overhead_ms"] = measure_head_overhead_ms()
    return extra


def run_profile(opts: ProfileOptions, comm=None) -> dict | None:
    """Measure; rank 0 returns the profile (a dict ready for JSON), other ranks None."""
    from ..core.topology import parse_per_rank_ints, plan_layers
    from ..engine.kernels import numerics_id
    from ..engine.stagefile import ensure_stage_file, layer_costs, read_info
    from ..wire.hosts import host_name
    from ..wire.netprobe import ping_pong
    from ..wire.transport import polite_barrier

    size = comm.Get_size() if comm is not None else 1
    rank = comm.Get_rank() if comm is not None else 0
    n_stages = size if size > 1 else opts.ranks
    info = read_info(opts.model)
    ranges = plan_layers(opts.layer_split, info.n_layer, n_stages, *layer_costs(opts.model))
    threads = parse_per_rank_ints(opts.threads, n_stages, "--threads", default=1)
    mine = range(n_stages) if size == 1 else [rank]
    records: dict[int, dict] = {}
    for r in range(n_stages):
        if comm is not None and size > 1:
            polite_barrier(comm)
        if r not in mine:
            continue
        lr, last = ranges[r], r == n_stages - 1
        path = opts.model if n_stages == 1 else ensure_stage_file(opts.model, lr.start, lr.end, with_vocab=last)
        rec = measure_stage(path, embd_input=n_stages > 1, last=last, threads=threads[r], max_batch=opts.max_batch,
                            kernels=opts.kernels, exact=True)
        records[r] = {"rank": r, "host": host_name(), "machine": machine_id(), "cores": physical_cores(affinity()),
                      "threads": threads[r], "layers": [lr.start, lr.end], "last": last, **rec}
    extra = measure_on_head(opts, info.n_layer, threads[0]) if rank == 0 else {}
    links = []
    if size > 1:
        polite_barrier(comm)
        lr, last = ranges[rank], rank == size - 1
        slow = measure_shared_slowdown(comm, ensure_stage_file(opts.model, lr.start, lr.end, with_vocab=last),
                                       embd_input=True, last=last, threads=threads[rank], kernels=opts.kernels)
        records[rank]["shared_slowdown"] = round(slow, 3)
        polite_barrier(comm)
        all_records = comm.gather(records, root=0)
        for a in range(size):  # a <-> a+1, and the last rank back to the head
            b = (a + 1) % size
            sub = comm.Split(0 if rank in (a, b) else 1, 0 if rank == a else 1)
            if rank in (a, b):
                pp = ping_pong(sub, 1 - sub.Get_rank())
                if pp is not None:
                    links.append({"from": a, "to": b, "latency_s": pp.latency_s,
                                  "bandwidth_bps": pp.bandwidth_bit_s})
            sub.Free()
            polite_barrier(comm)
        link_lists = comm.gather(links, root=0)
        in_pipeline = measure_in_pipeline(comm, opts, info.n_vocab)
        text = workload_prompt()
        out = target_output(comm, opts, text) if opts.draft else None
        if rank != 0:
            return None
        if out is not None:
            extra["draft"]["confidence"] = measure_confidence(opts.draft, opts.model, out[0], text, out[1],
                                                              threads[0], opts.kernels)
        records = {k: v for d in all_records for k, v in d.items()}
        calibrate(records, in_pipeline)
        links = sorted((lk for ls in link_lists for lk in ls), key=lambda lk: lk["from"])
    limits = [records[r]["exact_batch"] for r in range(n_stages) if records[r]["exact_batch"] is not None]
    machines = [records[r]["machine"] for r in range(n_stages)]
    # with every rank decoding at once, a machine running more ranks than it has cores time-shares them;
    # what remains of the slowdown is the shared memory bandwidth
    shared = [records[r]["shared_slowdown"] / max(1.0, machines.count(machines[r]) / records[r]["cores"])
              for r in range(n_stages) if "shared_slowdown" in records[r] and machines.count(machines[r]) > 1]
    return {"format": PROFILE_FORMAT, "build": numerics_id(), "kernels": opts.kernels,
            "exact_batch": min(limits) if limits else opts.max_batch,
            # ranks on one machine slow each other's decodes (memory bandwidth): the twin applies this
            "shared_slowdown": round(max(1.0, statistics.median(shared)), 3) if shared else 1.0,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "model": {"path": os.path.basename(opts.model), "n_layer": info.n_layer, "n_embd": info.n_embd,
                      "n_vocab": info.n_vocab, "file_bytes": model_size(opts.model),
                      **dict(zip(("active_layer_bytes", "out_bytes"), weight_bytes(opts.model)))},
            "ranks": [records[r] for r in range(n_stages)], "links": links, **extra}
