"""Several generations of token prompts at once through one pipeline (decide/scheduler.py) under mpiexec; rank 0 prints
a JSON result line. The prompts are token ids, not text: tests/synth_arch.py's models cannot tokenize text.

Usage: mpiexec -n N python -m mpi4py tests/mpi_parallel.py '{"model": ..., "prompts": [[...], ...], "n": [...],
       "mode": ..., "parallel": k, ...}'
"""
import json
import sys

from pipeinfer.core.config import Config, DraftOptions, ServingOptions, SpeculationOptions, StageOptions
from pipeinfer.ranks.startup import open_session

cfg = json.loads(sys.argv[1])
config = Config(model=cfg["model"], mode=cfg.get("mode", "iterative"),
                stage=StageOptions(n_ctx=cfg.get("n_ctx", 512), threads="1",
                                   cache_prompt=cfg.get("cache_prompt", True)),
                draft=DraftOptions(drafter=cfg.get("drafter", "ngram"), replay_ref=cfg.get("replay_ref"),
                                   replay_accuracy=cfg.get("replay_accuracy", 0.8)),
                speculation=SpeculationOptions(draft_max=cfg.get("draft_max"), p_accept=cfg.get("p_accept", 0.0),
                                               adaptive_draft=cfg.get("micro_batch", "auto") == "auto"),
                serving=ServingOptions(parallel=cfg.get("parallel", 2), stop_at_eos=False),
                set_by_user=frozenset(cfg.get("set_by_user", ())))
session = open_session(config)
if session is not None:
    answers = {}
    sched = session.scheduler()
    for i, (prompt, n) in enumerate(zip(cfg["prompts"], cfg["n"])):
        sched.submit(session.request(prompt, n_predict=n, on_done=lambda toks, st, i=i: answers.__setitem__(i, toks)))
    sched.run()
    stats, _ = session.close()
    print("RESULT " + json.dumps({"answers": [answers[i] for i in range(len(cfg["prompts"]))],
                                  "max_active": sched.stats.max_active, "kv": [s["kv"] for s in stats]}))
