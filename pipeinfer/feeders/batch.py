"""`pipeinfer generate --prompts FILE`: an offline batch, every prompt of a file through one pipeline, several
at once (decide/scheduler.py; --parallel, default 4 per stage when requests share decodes: --batch-rows), one
JSON line per answer on stdout and one --results row per prompt.

FILE has one prompt per line, or JSON lines: {"prompt": "...", "n_predict": 64, "seed": 1, "temp": 0.7,
"chat": false, "replay": [token ids], "cache_prompt": false} (every key but "prompt" optional; the command line's values are the
defaults; "replay": tokens the answer already has, e.g. from an interrupted run: they are decoded after the
prompt as they were first generated, and the answer goes on exactly as the uninterrupted one would, for
n_predict more tokens; "cache_prompt": false: the prompt neither starts from nor stays in the prompt cache, where
prompts with a common head otherwise compute it once). Blank lines are skipped. Answers print as they finish:
{"index", "prompt", "text", "tokens", "n_generated", "finish", "ttft_s", "tokens_per_s", "queue_s", "n_cached"},
index counting the file's prompts from 0, n_cached the prompt tokens taken from the cache.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..core.config import check_fits
from ..wire.launcher import mpi_size
from ..core.errors import UserError
from ..core.results import results_row, write_row
from ..core.sampling import SamplingParams


@dataclass(frozen=True)
class BatchPrompt:
    index: int
    text: str
    chat: bool
    n_predict: int
    sampling: SamplingParams
    replay: tuple[int, ...] = ()
    cache_prompt: bool = True


def read_batch(path: str, *, chat: bool, n_predict: int, sampling: SamplingParams) -> list[BatchPrompt]:
    """The prompts of FILE (module docstring), each with its own settings or the command line's."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--prompts {path}: {e}") from None
    out: list[BatchPrompt] = []
    for no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if not line.lstrip().startswith("{"):
            out.append(BatchPrompt(len(out), line, chat, n_predict, sampling))
            continue
        try:
            obj = json.loads(line)
            text = obj["prompt"]
            if not isinstance(text, str) or not text:
                raise ValueError("'prompt' must be a non-empty string")
            sp = SamplingParams(float(obj.get("temp", sampling.temp)), int(obj.get("top_k", sampling.top_k)),
                                float(obj.get("top_p", sampling.top_p)), int(obj.get("seed", sampling.seed)))
            n = int(obj.get("n_predict", n_predict))
            replay = tuple(int(t) for t in obj.get("replay", ()))
            if n < 1 or sp.temp < 0 or not 0 < sp.top_p <= 1 or any(t < 0 for t in replay):
                raise ValueError("n_predict >= 1, temp >= 0, 0 < top_p <= 1 and token ids >= 0")
            cache = obj.get("cache_prompt", True)
            if not isinstance(cache, bool):
                raise ValueError("'cache_prompt' must be true or false")
            out.append(BatchPrompt(len(out), text, bool(obj.get("chat", chat)), n, sp, replay, cache))
        except (ValueError, KeyError, TypeError) as e:
            raise UserError(f"--prompts {path}, line {no}: not a prompt ({type(e).__name__}: {e})") from None
    if not out:
        raise UserError(f"--prompts {path}: no prompts in the file")
    return out


def answer_line(p: BatchPrompt, text: str, tokens: list[int], finish: str, stats, **more) -> str:
    """The JSON line of one answer (module docstring)."""
    return json.dumps({"index": p.index, "prompt": p.text, "text": text, "tokens": tokens, "n_generated": len(tokens),
                       "finish": finish, "ttft_s": round(stats.ttft_s, 4),
                       "tokens_per_s": round(stats.gen_tokens_per_s, 3), "queue_s": round(stats.t_queue_s, 3), "n_cached": stats.n_cached, **more})


def run_batch(args, stop) -> None:
    """Rank 0: every prompt through the scheduler; a JSON line per answer, a summary on stderr."""
    from ..engine.tokenizer import Tokenizer, encode_prompt
    from ..ranks.startup import open_session
    config = args.config
    prompts = read_batch(args.prompts, chat=True if args.chat is None else args.chat, n_predict=config.n_predict,
                         sampling=config.sampling)
    tok = Tokenizer(config.model)
    encoded = []
    for p in prompts:
        ids = encode_prompt(tok, p.text, p.chat)
        if any(t >= tok.n_vocab for t in p.replay):
            raise UserError(f"--prompts {args.prompts}: prompt {p.index} replays a token id outside the vocabulary "
                            f"({tok.n_vocab} tokens)")
        try:
            check_fits(config, len(ids) + len(p.replay), p.n_predict, mpi_size() - (config.draft_at == "rank"))
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
                    write_row(args.results, results_row(config, session.ranges, f"{name}:{p.index}", stats))
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
