"""Run one generation through pipeinfer.ranks.startup.run under mpiexec; rank 0 prints a JSON result line.

Usage: mpiexec -n N python -m mpi4py tests/mpi_gen.py '{"model": ..., "prompt": [...], "mode": ..., ...}'
       mpiexec -n N python -m mpi4py tests/mpi_gen.py @config.json
"""
import json
import sys

from pipeinfer.core.config import (
    DEFAULT_KERNELS,
    Config,
    DraftOptions,
    ServingOptions,
    SpeculationOptions,
    StageOptions,
    WireOptions,
)
from pipeinfer.core.decoding import Decoding
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.ranks.startup import run

arg = sys.argv[1]
cfg = json.loads(open(arg[1:]).read() if arg.startswith("@") else arg)  # @FILE: JSON from a file
config = Config(
    model=cfg["model"], mode=cfg.get("mode", "iterative"),
    stage=StageOptions(layer_split=cfg.get("split"), threads=cfg.get("threads", "1"), n_ctx=cfg.get("n_ctx", 1024),
                       n_batch=cfg.get("n_batch", 512), prompt_chunk=cfg.get("prompt_chunk", 63),
                       cache_prompt=cfg.get("cache_prompt", True), kernels=cfg.get("kernels", DEFAULT_KERNELS),
                       tensor_parallel=cfg.get("tp", 1), groups=cfg.get("groups")),
    draft=DraftOptions(model=cfg.get("draft"), below=tuple(cfg.get("draft_below", ())), drafter=cfg.get("drafter", "model"),
                       at=cfg.get("draft_at", "head"), below_at=cfg.get("draft_below_at", "inline"),
                       vocab=cfg.get("draft_vocab", "auto"), replay_ref=cfg.get("replay_ref"),
                       replay_accuracy=cfg.get("replay_accuracy", 0.8)),
    speculation=SpeculationOptions(
        p_accept=cfg.get("p_accept", 0.0), p_split=cfg.get("p_split", 1.0), p_recovery=cfg.get("p_recovery", 0.0),
        p_decay=cfg.get("p_decay", 0.0), max_branches=cfg.get("max_branches", 1),
        max_in_flight=cfg.get("max_in_flight", 8), draft_max=cfg.get("draft_max"),
        adaptive_draft=cfg.get("micro_batch", "auto") == "auto", cancel=cfg.get("cancel", True),
        continuous=cfg.get("continuous", True)),
    serving=ServingOptions(n_predict=cfg["n"], stop_at_eos=False,
                           sampling=SamplingParams(cfg.get("temp", 0.0), 0, 1.0, cfg.get("seed", 0))),
    wire=WireOptions(stall_timeout=cfg.get("stall_timeout", 60.0)))
logprobs = []  # "logprobs": k asks the chosen token's log-probability (and the top k) at every position
request = {} if cfg.get("logprobs") is None else {"decoding": Decoding(top_logprobs=cfg["logprobs"]),
                                                   "on_logprobs": logprobs.extend}
res = run(config, cfg["prompt"], prompt_text=cfg.get("prompt_text"), chat=cfg.get("chat", False), **request)
if res is not None:
    print("RESULT " + json.dumps({"tokens": res.tokens, "stats": res.stats.to_dict(),
                                  "logprobs": [x.logprob for x in logprobs],
                                  "ranges": [[r.start, r.end] for r in res.ranges], "threads": res.threads,
                                  "rss_mb": res.peak_rss_mb,
                                  "probe_ms": res.probe_ms_per_layer, "p_recovery": res.p_recovery}))
