"""Benchmark results as one CSV row per generation run.

File format: comma-separated (Python ``csv`` module, ``excel`` dialect),
UTF-8, a header line with exactly ``RESULT_COLUMNS`` in that order, then one
row per run. Missing values are empty fields. Only ``append_result`` writes it.

Columns
-------
timestamp         ISO 8601 UTC time the row was written (filled in when absent)
mode              inference strategy: "single" (one process), "iterative"
                  (pipeline-parallel, no speculation), "speculative"
                  (pipeline-parallel synchronous speculation, SpecInfer-style)
                  or "pipeinfer"
target_model      target GGUF (path or name)
draft_model       draft GGUF; empty for single/iterative
ranks             number of MPI ranks (int)
layer_split       per-rank layer weights as given, e.g. "0.1,0.45,0.45"
threads           per-rank thread counts, e.g. "2,2,2" (as start-up resolved them; as given when unknown)
prompt_name       prompt file stem, e.g. "code", "story", "encyclopedia"
n_prompt_tokens   prompt length in tokens (int)
n_generated       output tokens produced (int), including the token sampled
                  from the prompt's logits
pp_tokens_per_s   n_prompt_tokens / prompt processing time
gen_tokens_per_s  generation speed (below)
ttft_s            time to first token in seconds (below)
itl_mean_s        mean inter-token latency in seconds (below)
acceptance_rate   accepted draft tokens / draft tokens sent to the target,
                  in [0, 1]; empty for single/iterative
n_runs            target pipeline runs (decode batches) started (int)
n_cancelled       of those, runs cancelled before completion (int)
peak_rss_max_mb   largest peak resident set size of any rank, MiB
peak_rss_sum_mb   sum over ranks of the peak resident set size, MiB
version           pipeinfer version that produced the row
kernels           --kernels setting (repack, no-repack, fast)
exact_batch_limit smallest exact batch limit of the stages (empty: fast kernels)
bytes_per_token   bytes sent per generated token on each link, rank r -> r+1
                  (the last: -> rank 0), comma-separated, rank 0's link first
simulated         "twin" for a row predicted by `pipeinfer simulate` (pipeinfer/twin), empty
                  for a measured run
status            "ok", or "failed: REASON" for a generation that a lost or
                  silent rank ended (its counts and times are those reached
                  before the failure; docs/failures.md), or "ok:
                  resumed N" for an answer a supervised server completed
                  after N lost ranks (its times are the last job's)
draft_bytes_per_token  --draft-at rank: bytes sent per generated token on the
                  head <-> draft rank link, "to the draft,back"; empty otherwise

A file written before the last columns existed is upgraded in place the next
time a row is appended (its header extended, old rows padded with empty
fields; an old row's empty status means "ok": only successful runs were
written then).

Timing definitions (after the PipeInfer paper, section V.A)
-----------------------------------------------------------
All times are wall-clock (monotonic clock) on rank 0, the head. The paper used
the main thread's CPU time for TTFT and ITL; wall-clock includes waiting.

* Prompt processing ("prefill") runs from the first decode of the prompt to
  the moment its logits are available; the token sampled from those logits is
  *not* the first token for TTFT, since neither speculation nor PipeInfer is
  engaged during prompt processing (paper V.A, metric 2).
* TTFT = time from the end of prompt processing to the first token accepted
  after it (the first token produced by the inference strategy itself).
* ITL = mean time between consecutive accepted tokens after the first one,
  i.e. (t_last - t_first) / (n - 1) over the tokens accepted after prompt
  processing; tokens accepted together count with a gap of 0.
* Generation speed = n_generated / (t_end - t_prompt_done): wall-clock time
  from the end of prompt processing to the end of inference. Prompt
  processing is excluded (paper V.A, metric 1).
* Memory: the paper counts the pages of the memory-mapped model each node
  actually faulted in (pmap); peak RSS per rank measures the same thing.
"""
from __future__ import annotations

import csv
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__
from .config import Config, draft_label
from .errors import UserError
from .metrics import Stats

__all__ = ["RESULT_COLUMNS", "INT_COLUMNS", "FLOAT_COLUMNS", "append_result", "read_results", "stats_row"]

RESULT_COLUMNS: list[str] = [
    "timestamp", "mode", "target_model", "draft_model", "ranks", "layer_split", "threads",
    "prompt_name", "n_prompt_tokens", "n_generated", "pp_tokens_per_s", "gen_tokens_per_s",
    "ttft_s", "itl_mean_s", "acceptance_rate", "n_runs", "n_cancelled",
    "peak_rss_max_mb", "peak_rss_sum_mb", "version", "kernels", "exact_batch_limit", "bytes_per_token",
    "simulated", "status", "draft_bytes_per_token",
]
INT_COLUMNS = frozenset({"ranks", "n_prompt_tokens", "n_generated", "n_runs", "n_cancelled", "exact_batch_limit"})
FLOAT_COLUMNS = frozenset({"pp_tokens_per_s", "gen_tokens_per_s", "ttft_s", "itl_mean_s",
                           "acceptance_rate", "peak_rss_max_mb", "peak_rss_sum_mb"})


def stats_row(s: Stats, **columns) -> dict:
    """A results row: the columns a generation's Stats measure (and this version), then ``columns``, what
    the caller knows of the run (mode, models, ranks, ...); a column given in ``columns`` wins."""
    known = [x for x in (s.exact_batch or []) if x is not None]
    try:
        per_link = [round(b) for b in s.bytes_per_token()]
    except (TypeError, ValueError, ZeroDivisionError, AttributeError):  # a generation cut short: unknown
        per_link = None
    row = {
        "n_prompt_tokens": s.n_prompt, "n_generated": s.n_generated,
        "pp_tokens_per_s": round(s.pp_tokens_per_s, 3), "gen_tokens_per_s": round(s.gen_tokens_per_s, 3),
        "ttft_s": round(s.ttft_s, 4), "itl_mean_s": round(s.itl_s, 4),
        "acceptance_rate": round(s.acceptance_rate, 4), "n_runs": s.n_runs, "n_cancelled": s.n_cancelled,
        "version": __version__, "kernels": s.kernels, "exact_batch_limit": min(known) if known else None,
        "bytes_per_token": per_link,
        "draft_bytes_per_token": [round(b) for b in s.draft_bytes_per_token()] if s.draft_link_bytes else None,
    }
    return {**row, **columns}


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return ",".join(str(v) for v in value)
    return str(value)


def append_result(path: str | os.PathLike, row: dict) -> None:
    """Append ``row`` to the CSV at ``path``.

    Creates the parent directory, and writes the header when the file is new
    or empty. Keys missing from ``row`` are written empty (``timestamp``
    defaults to now); a key not in ``RESULT_COLUMNS`` raises ``ValueError``,
    and so does an existing file whose header differs. Lists are joined
    with commas.
    """
    unknown = [k for k in row if k not in RESULT_COLUMNS]
    if unknown:
        raise ValueError(f"unknown result column(s): {', '.join(map(str, unknown))}")
    row = dict(row)
    if not row.get("timestamp"):
        row["timestamp"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists() or path.stat().st_size == 0
    if not new:
        with open(path, newline="", encoding="utf-8") as f:
            header = next(csv.reader(f), [])
        if header != RESULT_COLUMNS:
            if not header or header != RESULT_COLUMNS[:len(header)]:
                raise ValueError(f"{path}: not a pipeinfer results file (its header does not match): {header[:4]}...")
            _upgrade(path, len(RESULT_COLUMNS) - len(header))
    with open(path, "a", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        if new:
            w.writerow(RESULT_COLUMNS)
        w.writerow([_cell(row.get(c)) for c in RESULT_COLUMNS])


def _upgrade(path: Path, n_new: int) -> None:
    """Extend an older file's header to RESULT_COLUMNS and pad its rows (columns are only ever added at the end)."""
    from .files import write_atomically
    with open(path, newline="", encoding="utf-8") as f:
        rows = list(csv.reader(f))

    def write(tmp: Path) -> None:
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(RESULT_COLUMNS)
            w.writerows(r + [""] * n_new for r in rows[1:])
    write_atomically(path, write)


def _convert(col: str, text: str):
    if text == "":
        return None
    try:
        if col in INT_COLUMNS:
            return int(float(text))
        if col in FLOAT_COLUMNS:
            return float(text)
    except ValueError:
        return text
    return text


def read_results(path: str | os.PathLike) -> list[dict]:
    """Rows of a results CSV as dicts keyed by column.

    Empty fields become ``None``; ``INT_COLUMNS`` become ``int`` and
    ``FLOAT_COLUMNS`` ``float`` (left as text when they do not parse); the rest
    stay strings. A missing or empty file gives ``[]``.
    """
    path = Path(path)
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return [{c: _convert(c, (r.get(c) or "")) for c in (reader.fieldnames or [])}
                for r in reader]


def results_row(config: Config, ranges, prompt_name: str, stats, peak_rss_mb: list[float] | None = None,
                 status: str = "ok", threads: list[int] | None = None) -> dict:
    """A --results row of a generation: `status` is "ok" or "failed: REASON" (ranges may then be unknown: None
    per rank); peak RSS per rank when known (generate has it, a served request not); each rank's threads as
    start-up resolved them when known, else as given."""
    return stats_row(
        stats, timestamp=time.strftime("%Y-%m-%dT%H:%M:%S"), mode=config.mode, target_model=Path(config.model).name,
        draft_model=draft_label(config), ranks=len(ranges),
        layer_split=",".join(str(r.n_layers) for r in ranges if r is not None),
        threads=",".join(map(str, threads)) if threads else config.stage.threads or "",
        prompt_name=prompt_name, peak_rss_max_mb=round(max(peak_rss_mb), 1) if peak_rss_mb else None,
        peak_rss_sum_mb=round(sum(peak_rss_mb), 1) if peak_rss_mb else None, status=status)


def write_row(path: str, row: dict) -> None:
    try:
        append_result(path, row)
    except (ValueError, OSError) as e:  # the text is out already; only the row could not be written
        raise UserError(f"--results {path}: {e}") from None
