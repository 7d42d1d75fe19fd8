#!/usr/bin/env python3
"""Benchmark in simulation: drafts of drafts for a 70B-class target on 8 hosts, with the digital twin.

    python launch/twin/twin_levels.py --profile results/twin_profile_2ranks.json [-n 256] [--out results/twin_levels.csv]

The target is twin_scaling.py's 70B shape on 8 hosts like the profiled rank 0 (1 Gbit/s, 100 us links); the drafts run
on a host of their own (own) or share the head's (head). Each draft's one-row decode is the profiled model's whole-model token time scaled by file
bytes (an 8B at Q4_K_M: 4.92 GB, a 1B: 0.81 GB, against the profiled 1.5B's). A hierarchy is priced by the rule the
real one follows (pipeinfer/twin/levels.py, drafters/stack.py's verify_len) and simulated as one draft of that cost
with the first level's agreement with the target:

- one level: the 8B alone (agreement with the 70B: 0.8), the 1B alone (0.6);
- two levels: the 1B drafting for the 8B, at agreements 0.5, 0.7 and 0.9 with it; three: the n-gram drafter under
  the 1B (0.3 with it).

Each hierarchy twice: with CPU row costs (a decode of b rows costs what this machine measured, about b single
decodes) and with flat ones (b rows cost one row: PipeSpec's GPUs), to check PipeSpec's claim that any non-zero
acceptance gains. The agreements are assumptions, not measurements: the registry has no 70B, 8B or 1B of one family.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path()

from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.twin.cluster import Link  # noqa: E402
from pipeinfer.twin.levels import CPU_ROWS, FLAT_ROWS, Level, price  # noqa: E402
from pipeinfer.twin.plan import Shape, build_cluster, load_profile  # noqa: E402
from pipeinfer.twin.sim import simulate  # noqa: E402
from twin_scaling import BPW_Q4_K_M, LLAMA_70B  # noqa: E402

GB_8B, GB_1B = 4.92e9, 0.81e9
AGREE_8B, AGREE_1B_TARGET, AGREE_NGRAM = 0.8, 0.6, 0.3
HOSTS = 8


def whole_model_ms(prof: dict) -> float:
    """The profiled model's one-row token time on one host: every layer, the fixed cost and the output."""
    lm = prof["layer_model"]
    n_layer = prof["model"]["n_layer"]
    return lm["fixed_ms"][0] + n_layer * lm["layer_ms"][0] / lm["probe_layers"] + lm["out_ms"][0]


def hierarchies(ms_8b: float, ms_1b: float) -> list[tuple[str, list[Level]]]:
    out = [("8B", [Level("8B", ms_8b, AGREE_8B)]), ("1B", [Level("1B", ms_1b, AGREE_1B_TARGET)])]
    for a in (0.5, 0.7, 0.9):
        out.append((f"8B<1B@{a}", [Level("8B", ms_8b, AGREE_8B), Level("1B", ms_1b, a)]))
    out.append(("8B<1B@0.9<ngram", [Level("8B", ms_8b, AGREE_8B), Level("1B", ms_1b, 0.9),
                                    Level("ngram", 0.0, AGREE_NGRAM)]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True)
    ap.add_argument("-n", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_levels.csv"))
    args = ap.parse_args()
    prof = load_profile(args.profile)
    profiled_bytes = prof["model"]["file_bytes"]
    ms = whole_model_ms(prof)
    ms_8b, ms_1b = ms * GB_8B / profiled_bytes, ms * GB_1B / profiled_bytes
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.twin.profile import weight_bytes
    per_layer, output = weight_bytes(resolve_model("qwen2.5-coder-1.5b"))  # as twin_scaling.py scales
    shape_kw = dict(hosts=HOSTS, n_layer=LLAMA_70B.n_layer, n_embd=LLAMA_70B.n_embd,
                    layer_scale=LLAMA_70B.active_params_per_layer * BPW_Q4_K_M / 8 / per_layer,
                    out_scale=LLAMA_70B.output_bytes / output, link=Link(100e-6, 1e9 / 8))
    print(f"70B on {HOSTS} hosts; one-row draft decodes: 8B {ms_8b:.0f} ms, 1B {ms_1b:.0f} ms (the profiled "
          f"{ms:.0f} ms scaled by bytes)")
    limit = int(prof.get("exact_batch", 3))
    gen = GenConfig(mode="iterative", n_predict=args.n, draft_max=1, p_recovery=None, stop_at_eos=False)
    base = simulate(build_cluster(prof, Shape(**shape_kw, draft_ms=ms_8b)), gen, agreement=AGREE_8B).stats
    rows = [{"hierarchy": "none (iterative)", "draft_on": "", "rows": "", "draft_ms_per_token": "", "verify": "",
             "agreement": "", "tokens_per_s": round(base.gen_tokens_per_s, 4), "vs_iterative": 1.0, "vs_8b_alone": ""}]
    print(f"iterative: {base.gen_tokens_per_s:.3f} tokens/s")
    for draft_on, (rows_name, factor) in itertools.product(("own", "head"), (("cpu", CPU_ROWS), ("flat", FLAT_ROWS))):
        alone = None
        for name, levels in hierarchies(ms_8b, ms_1b):
            priced = price(levels, factor)
            gen = GenConfig(mode="pipeinfer", n_predict=args.n, draft_max=limit, p_recovery=None, stop_at_eos=False)
            cluster = build_cluster(prof, Shape(**shape_kw, draft_on=draft_on, draft_ms=priced.ms_per_token))
            s = simulate(cluster, gen, agreement=levels[0].agreement).stats
            alone = s.gen_tokens_per_s if name == "8B" else alone
            rows.append({"hierarchy": name, "draft_on": draft_on, "rows": rows_name, "draft_ms_per_token": round(priced.ms_per_token, 1),
                         "verify": "/".join(map(str, priced.verify)), "agreement": levels[0].agreement,
                         "tokens_per_s": round(s.gen_tokens_per_s, 4),
                         "vs_iterative": round(s.gen_tokens_per_s / base.gen_tokens_per_s, 3),
                         "vs_8b_alone": round(s.gen_tokens_per_s / alone, 3) if alone else ""})
            print(f"draft on {draft_on:<4} {rows_name:>4} rows  {name:<18} draft {priced.ms_per_token:7.1f} ms/token (verify "
                  f"{'/'.join(map(str, priced.verify)) or '-'}): pipeinfer {s.gen_tokens_per_s:.3f} tokens/s, "
                  f"{s.gen_tokens_per_s / base.gen_tokens_per_s:.2f}x iterative", flush=True)
    write_csv(Path(args.out), rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
