"""Run several requests, one after another, on one pipeline under mpiexec; rank 0 prints one JSON line per answer
(its tokens and, when asked, its log-probabilities).

Usage: mpiexec -n N python -m mpi4py tests/mpi_requests.py @spec.json
spec: {"config": {Config fields; sampling as a dict}, "requests": [{"prompt": [ids], "n": N, "decoding": {...},
       "sampling": {...}}, ...]}
"""
import json
import sys
from dataclasses import asdict

from pipeinfer.core.config import Config
from pipeinfer.core.decoding import Decoding
from pipeinfer.core.verify import SamplingParams
from pipeinfer.ranks.startup import open_session

arg = sys.argv[1]
spec = json.loads(open(arg[1:]).read() if arg.startswith("@") else arg)
config = Config.from_json(json.dumps({**asdict(Config(spec["config"]["model"])), **spec["config"]}))
session = open_session(config)
if session is not None:
    try:
        for req in spec["requests"]:
            logprobs: list = []
            sampling = SamplingParams(**req["sampling"]) if "sampling" in req else None
            stats = session.generate(req["prompt"], n_predict=req["n"], sampling=sampling,
                                     decoding=Decoding.from_dict(req.get("decoding")),
                                     on_logprobs=lambda lps: logprobs.extend(asdict(lp) for lp in lps))
            print("ANSWER " + json.dumps({"tokens": session.last_tokens, "logprobs": logprobs,
                                          "acceptance": stats.acceptance_rate}), flush=True)
    finally:
        session.close()
