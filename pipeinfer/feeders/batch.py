"""`pipeinfer generate --prompts FILE`: an offline batch, every prompt of a file through one pipeline, several
at once (decide/scheduler.py; --parallel, default 4 per stage when requests share decodes: --batch-rows), one
JSON line per answer on stdout (the file and the lines: serving/batchfile.py) and one --results row per prompt.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

from ..core.config import check_fits
from ..wire.launcher import mpi_size
from ..core.errors import UserError
from ..core.results import results_row, write_row
from ..serving.batchfile import answer_line, read_batch


def run_batch(args, stop) -> None:
    """Rank 0: every prompt through the scheduler; a JSON line per answer, a summary on stderr."""
    from ..engine.tokenizer import Tokenizer, encode_prompt
    from ..ranks.startup import open_session
    config = args.config
    prompts = read_batch(args.prompts, chat=True if args.chat is None else args.chat,
                         n_predict=config.serving.n_predict, sampling=config.serving.sampling)
    tok = Tokenizer(config.model)
    encoded = []
    for p in prompts:
        ids = encode_prompt(tok, p.text, p.chat)
        if any(t >= tok.n_vocab for t in p.replay):
            raise UserError(f"--prompts {args.prompts}: prompt {p.index} replays a token id outside the vocabulary "
                            f"({tok.n_vocab} tokens)")
        try:
            check_fits(config, len(ids) + len(p.replay), p.n_predict, mpi_size() - (config.draft.at == "rank"))
        except UserError as e:
            raise UserError(f"--prompts {args.prompts}: prompt {p.index}: {e}") from None
        encoded.append(ids)
    tok.close()
    session = open_session(config)
    name = Path(args.prompts).stem
    n_tokens, t0 = 0, time.perf_counter()
    sched = None
    try:
        sched = session.scheduler()
        for p, ids in zip(prompts, encoded):
            def done(tokens: list[int], stats, p=p) -> None:
                nonlocal n_tokens
                n_tokens += len(tokens)
                finish = "stopped" if stop.requested else ("length" if len(tokens) >= p.n_predict else "stop")
                print(answer_line(p, session.tok.decode(tokens), tokens, finish, stats), flush=True)
                if args.results:
                    write_row(args.results, results_row(config, session.ranges, f"{name}:{p.index}", stats,
                                                        threads=session.threads))
            sched.submit(session.request(ids, n_predict=p.n_predict, sampling=p.sampling, prompt_text=p.text,
                                         chat=p.chat, should_stop=lambda: stop.requested, on_done=done,
                                         replay=list(p.replay), cache_prompt=p.cache_prompt))
        sched.run()
    finally:
        session.close()
    wall_s = time.perf_counter() - t0
    if not args.quiet:
        st = sched.stats
        print(f"[pipeinfer] {len(prompts)} prompts, {session.parallel} at once: {n_tokens} tokens in {wall_s:.1f} s, "
              f"{n_tokens / wall_s:.2f} tokens/s; at most {st.max_active} generating, {st.waits_for_cells} rounds "
              f"waiting for KV cells, {st.n_compactions} compactions, {sched.executor.n_merged_runs} decodes carrying "
              f"{sched.executor.n_merged_rows} requests' next tokens (up to {sched.rules.batch_rows} per decode), "
              f"{sched.executor.n_rides} draft micro-batches riding them ({sched.executor.n_riders_dropped} dropped "
              f"when cancelled)"
              + (f", {sched.cache.n_tokens_reused} prompt tokens from the cache" if sched.cache else ""), file=sys.stderr)
