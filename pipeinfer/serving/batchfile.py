"""The prompts file of `pipeinfer generate --prompts FILE` and its answer lines, which rank 0's batch
(feeders/batch.py) and a supervised batch (supervisor/resume.py) both read and write.

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
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError
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
