"""`pipeinfer generate --np N` / `--hostfile HOSTS` (run without mpiexec): one generation that survives a lost
rank. The supervisor (supervisor.py) runs the pipeline as a child job and, when a rank is lost or goes silent,
re-forms it on the slots left and resumes the generation from the tokens already printed; the text on stdout
just pauses, and it is the text an uninterrupted run prints.
"""
from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path

from ..core.errors import UserError
from ..core.results import results_row, write_row
from ..core.decoding import Decoding
from ..serving.job import DoneEvent, ErrorEvent, Event, TextEvent


class StdoutJob:
    """A supervised `generate`'s job (serving/job.Generation): the text goes to stdout as it comes (or, with --json,
    at the end)."""

    def __init__(self, prompt_tokens: list[int], n_predict: int, sampling, prompt_text: str, chat: bool,
                 as_json: bool, cache_prompt: bool = True):
        self.prompt_tokens, self.n_predict, self.sampling = prompt_tokens, n_predict, sampling
        self.cache_prompt = cache_prompt  # false: neither starts from the prompt cache nor stays in it
        self.decoding, self.meter = Decoding(), None
        self.prompt_text, self.chat, self.stops, self.as_json = prompt_text, chat, [], as_json
        self.request_id = uuid.uuid4().hex[:24]
        self.t_queued_s, self.t_first_token_s = time.perf_counter(), 0.0
        self.cancelled = threading.Event()
        self.finished = threading.Event()
        self.tokens: list[int] = []
        self.text = ""
        self.outcome: DoneEvent | ErrorEvent | None = None

    def on_token_ids(self, tokens: list[int]) -> None:
        self.tokens += tokens

    def push(self, event: Event) -> None:
        if isinstance(event, TextEvent):
            self.text += event.text
            if not self.as_json:
                sys.stdout.write(event.text)
                sys.stdout.flush()
            return
        self.outcome = event
        self.finished.set()


def _run_supervised(args, where, tok, jobs: list[StdoutJob], on_done, stop):
    """`jobs` on a supervised pipeline until each has finished (a stop signal cancels them all); on_done(sup, job,
    stats, finish, n_resumes) as each finishes. Returns the stopped supervisor (its fatal, slots, lost)."""
    from .supervisor import Supervisor

    def log(msg: str) -> None:
        if not args.quiet or "re-form" in msg:
            print(msg.replace("[serve]", "[pipeinfer]"), file=sys.stderr, flush=True)
    # on_fatal: nothing to stop here; the jobs end with the error, and the caller reports sup.fatal
    sup = Supervisor(where.slots, where.config, tok,
                     log=log, on_done=lambda *done: on_done(sup, *done), footprint=where.footprint,
                     rejoin=args.rejoin, draft=where.draft, on_fatal=lambda _why: None)
    try:
        sup.start()
        for job in jobs:
            sup.submit(job)
        for job in jobs:
            while not job.finished.wait(0.2):
                if stop.requested:
                    for j in jobs:
                        j.cancelled.set()
    finally:
        sup.stop()
    return sup


def generate_supervised(args, where, prompt, stop) -> None:
    """The generation under the supervisor; the answer on stdout, the statistics and a --results row as usual."""
    from ..engine.tokenizer import Tokenizer, encode_prompt
    from .inflight import resumed_status
    tok = Tokenizer(args.config.model)
    ids = encode_prompt(tok, prompt.text, bool(prompt.chat))
    serving = args.config.serving
    job = StdoutJob(ids, serving.n_predict, serving.sampling, prompt.text, bool(prompt.chat), args.as_json)
    resumed: list[int] = []

    def on_done(sup, _job, stats, finish, n_resumes=0):
        resumed.append(n_resumes)
        if args.results:
            write_row(args.results, results_row(args.config, [None] * len(sup.slots), prompt.name, stats,
                                                status=resumed_status(n_resumes)))
    sup = _run_supervised(args, where, tok, [job], on_done, stop)
    if not isinstance(job.outcome, DoneEvent):
        why = sup.fatal or (job.outcome.message if job.outcome else "the generation did not finish")
        if args.results:  # the row of what was generated before the failure, as an unsupervised run writes it
            from ..core.metrics import Stats
            done = Stats(n_prompt=len(ids), n_generated=len(job.tokens))
            write_row(args.results, results_row(args.config, [None] * len(sup.slots), prompt.name, done,
                                                status=f"failed: {why}"))
        raise UserError(why)
    if args.as_json:
        print(json.dumps({"text": job.text, "tokens": job.tokens, "prompt_tokens": ids,
                          "stats": job.outcome.stats.to_dict(), "resumed": resumed[0] if resumed else 0,
                          "lost": sup.lost}))
    else:
        sys.stdout.write("\n")
        sys.stdout.flush()


def batch_supervised(args, where, stop) -> None:
    """`generate --prompts FILE --np/--hostfile`: every prompt a job of the supervisor (rank 0's scheduler runs
    --parallel of them at once), each answer a JSON line as it finishes (batch.py's, with "resumed": how many
    times the job re-formed under it), and the jobs in flight resumed where a rank is lost."""
    from ..engine.tokenizer import Tokenizer, encode_prompt
    from ..serving.batchfile import answer_line, read_batch
    from .inflight import resumed_status
    prompts = read_batch(args.prompts, chat=True if args.chat is None else args.chat,
                         n_predict=args.config.serving.n_predict,
                         sampling=args.config.serving.sampling)
    if any(p.replay for p in prompts):
        raise UserError(f"--prompts {args.prompts}: 'replay' is not taken under --np/--hostfile (the supervisor "
                        "replays what it streamed itself)")
    tok = Tokenizer(args.config.model)
    jobs = [StdoutJob(encode_prompt(tok, p.text, p.chat), p.n_predict, p.sampling, p.text,
                      p.chat, as_json=True, cache_prompt=p.cache_prompt) for p in prompts]
    prompt_of = {id(job): p for p, job in zip(prompts, jobs)}
    name = Path(args.prompts).stem

    def on_done(sup, job, stats, finish, n_resumes=0):
        p = prompt_of[id(job)]
        print(answer_line(p, job.text, job.tokens, finish, stats, resumed=n_resumes), flush=True)
        if args.results:
            write_row(args.results, results_row(args.config, [None] * len(sup.slots), f"{name}:{p.index}", stats,
                                                status=resumed_status(n_resumes)))
    sup = _run_supervised(args, where, tok, jobs, on_done, stop)
    failed = [p.index for p, job in zip(prompts, jobs) if not isinstance(job.outcome, DoneEvent)]
    if failed:
        raise UserError(sup.fatal or f"prompts {', '.join(map(str, failed))} did not finish")
