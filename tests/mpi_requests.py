"""Run several requests, one after another, on one pipeline under mpiexec; rank 0 prints one JSON line per answer
(its tokens and, when asked, its log-probabilities).

Usage: mpiexec -n N python -m mpi4py tests/mpi_requests.py @spec.json
spec: {"config": {"model": PATH, "mode": MODE, and options by their command-line names, as Config.with_options
       takes them}, "requests": [{"prompt": [ids], "n": N, "decoding": {...}, "sampling": {...}}, ...],
       "at_once": false}
at_once: every request submitted to the scheduler together (up to the config's parallel generate at once); the
answers are printed in request order.
"""
import json
import sys
from dataclasses import asdict

from pipeinfer.core.config import Config
from pipeinfer.core.decoding import Decoding
from pipeinfer.core.sampling import SamplingParams
from pipeinfer.decide.scheduler import generate
from pipeinfer.ranks.startup import open_session

arg = sys.argv[1]
spec = json.loads(open(arg[1:]).read() if arg.startswith("@") else arg)
options = dict(spec["config"])
config = Config(options.pop("model"), mode=options.pop("mode", "pipeinfer")).with_options(**options)
session = open_session(config)


def request(req: dict, on_done):
    logprobs: list = []
    sampling = SamplingParams(**req["sampling"]) if "sampling" in req else None
    r = session.request(req["prompt"], n_predict=req["n"], sampling=sampling,
                        decoding=Decoding.from_dict(req.get("decoding")),
                        on_logprobs=lambda lps: logprobs.extend(asdict(lp) for lp in lps),
                        on_done=lambda tokens, stats: on_done(tokens, stats, logprobs))
    return r


def answer(tokens, stats, logprobs) -> str:
    return "ANSWER " + json.dumps({"tokens": tokens, "logprobs": logprobs, "acceptance": stats.acceptance_rate})


if session is not None:
    try:
        sched = session.scheduler()
        if spec.get("at_once"):
            done: dict = {}
            for i, req in enumerate(spec["requests"]):
                sched.submit(request(req, lambda t, s, lp, i=i: done.__setitem__(i, answer(t, s, lp))))
            sched.run()
            for i in range(len(spec["requests"])):
                print(done[i], flush=True)
        else:
            for req in spec["requests"]:
                out: list = []
                generate(sched, request(req, lambda t, s, lp: out.append(answer(t, s, lp))))
                print(out[0], flush=True)
    finally:
        session.close()
