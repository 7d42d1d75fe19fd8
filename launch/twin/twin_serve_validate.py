#!/usr/bin/env python3
"""The twin's batched serving against the real server: `pipeinfer serve` (the default: PipeInfer, batched users at
the exact limit) on 2 ranks x 1 thread under 8 and 16 closed-loop clients, and the twin running the real scheduler
on the profile of this machine under the same load, side by side in one run.

    python launch/twin/twin_serve_validate.py [--clients 8 16] [--requests-per-client 4] [--max-tokens 64]
                                              [--profile P] [--out results/twin_serve_validate.csv]

Real: launch/bench/serve_load.run_load (the openai client, greedy and seeded prompts, streaming and not; every answer
checked against the same request alone). Twin: sim.simulate_clients on cluster_from_profile(--profile, default the
profile pipeinfer ships, measured on this machine) with serve's defaults (--parallel for 2 stages, batching; the
exact batch limit; the profiled draft's measured confidence), each request's prompt the mean chat-templated prompt
of the real mix and its answer the mean completion the real run produced. Prints measured / predicted tokens/s and
p50 latency for each client count (the issue's goal: within 20%).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, on_path, write_csv  # noqa: E402

on_path("bench")  # bench/serve_load.py, the real load

import serve_load  # noqa: E402

from pipeinfer.engine.models import resolve_model  # noqa: E402
from pipeinfer.decide.genconfig import GenConfig  # noqa: E402
from pipeinfer.decide.batching import default_parallel  # noqa: E402
from pipeinfer.twin.cluster import cluster_from_profile  # noqa: E402
from pipeinfer.twin.plan import REFERENCE_PROFILE, load_profile  # noqa: E402
from pipeinfer.twin.sim import simulate_clients  # noqa: E402


def mean_prompt_tokens() -> int:
    """The real mix's prompts as the server templates them (the model's own chat template)."""
    from pipeinfer.engine.tokenizer import Tokenizer, apply_chat, encode_prompt
    tok = Tokenizer(str(resolve_model("qwen2.5-coder-1.5b")))
    return round(statistics.mean(len(encode_prompt(tok, apply_chat(tok, [{"role": "user", "content": p}]), True))
                                 for p in serve_load.PROMPTS))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--requests-per-client", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--profile", default=str(REFERENCE_PROFILE))
    ap.add_argument("--out", default=str(ROOT / "results" / "twin_serve_validate.csv"))
    a = ap.parse_args()
    loads = [(c, c * a.requests_per_client) for c in a.clients]
    out = Path(a.out)
    rows, summaries, _ = serve_load.run_load(["-t", "1", "-c", "4096"], out.with_suffix(".server.log"), loads,
                                            a.max_tokens, ("plain", "stream"), None)
    prof = load_profile(a.profile)
    cluster = cluster_from_profile(prof)
    cap = int(prof.get("exact_batch", 3))
    n_prompt = mean_prompt_tokens()
    table = []
    for (n_clients, n_requests), real in zip(loads, summaries):
        done = [r for r in rows if r["clients"] == n_clients and r["status"] == "ok"]
        n_predict = max(1, round(statistics.mean(r["completion_tokens"] for r in done)))
        gen = replace(GenConfig(stop_at_eos=False), mode="pipeinfer", n_predict=n_predict, p_recovery=None,
                      draft_max=cap, batch_rows=cap)
        sim = simulate_clients(cluster, gen, n_clients=n_clients, n_requests=n_requests, n_prompt=n_prompt,
                               n_parallel=default_parallel(len(prof["ranks"]), batching=True),
                               confidence=(prof.get("draft") or {}).get("confidence"))
        table.append({"clients": n_clients, "requests": n_requests, "n_prompt": n_prompt, "n_predict": n_predict,
                      "measured_tokens_per_s": real["tokens_per_s"], "predicted_tokens_per_s": round(sim.tokens_per_s, 3),
                      "tokens_per_s_ratio": round(real["tokens_per_s"] / sim.tokens_per_s, 3),
                      "measured_p50_s": real["p50_s"], "predicted_p50_s": round(sim.p50_latency_s, 3),
                      "p50_ratio": round(real["p50_s"] / sim.p50_latency_s, 3), "lost_or_different": real["bad"]})
    write_csv(out, table)
    for t in table:
        print(f"{t['clients']:>3} clients ({t['n_prompt']} + {t['n_predict']} tokens): tokens/s measured "
              f"{t['measured_tokens_per_s']:.2f}, twin {t['predicted_tokens_per_s']:.2f} (x{t['tokens_per_s_ratio']:.2f}); "
              f"p50 measured {t['measured_p50_s']:.2f} s, twin {t['predicted_p50_s']:.2f} s (x{t['p50_ratio']:.2f}); "
              f"{t['lost_or_different']} lost or different")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
