"""How a request asks its tokens to be drawn (SamplingParams), and how a run carries that to the last stage: group by
group of its output rows (RunSampling), each generation's rows of a shared run by its own. The drawing itself is
verify.py's (row_tokens), at the last stage.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingParams:
    temp: float = 0.0    # <= 0: greedy (argmax)
    top_k: int = 0       # 0: off
    top_p: float = 1.0   # 1: off
    seed: int = 0


@dataclass(frozen=True)
class Drawing:
    """How the last stage draws one group of a run's consecutive output rows: by these sampling parameters, with
    top_logprobs log-probabilities reported for each (None: none)."""
    params: SamplingParams = SamplingParams()
    top_logprobs: int | None = None
    n_rows: int = 0   # the group's output rows; 0 in the run's last group: every row left


# how the last stage draws a run's output rows, group by group (a run of one generation: one group); a run shared
# by several generations draws each one's rows by its own
RunSampling = tuple[Drawing, ...]


def one_sampling(sp: SamplingParams, top_logprobs: int | None = None) -> RunSampling:
    """Every output row of a run drawn alike."""
    return (Drawing(sp, top_logprobs),)


def joined_sampling(parts: list[tuple[RunSampling, int]]) -> RunSampling:
    """The sampling of a run made of several runs, each (its one-group sampling, its output rows) in row order:
    neighbours drawn alike share a group; runs without an output row draw nothing."""
    groups: list[Drawing] = []
    for sampling, n_rows in parts:
        if not n_rows:
            continue
        (d,) = sampling
        if groups and (groups[-1].params, groups[-1].top_logprobs) == (d.params, d.top_logprobs):
            groups[-1] = Drawing(d.params, d.top_logprobs, groups[-1].n_rows + n_rows)
        else:
            groups.append(Drawing(d.params, d.top_logprobs, n_rows))
    if not groups:
        return parts[0][0]
    return (*groups[:-1], Drawing(groups[-1].params, groups[-1].top_logprobs))


def group_rows(sampling: RunSampling, n_rows: int) -> list[tuple[Drawing, slice]]:
    """Each group of a run of n_rows output rows with its rows (ValueError when the groups do not fit the run)."""
    out, at = [], 0
    for i, d in enumerate(sampling):
        last = i == len(sampling) - 1
        n = n_rows - at if last else d.n_rows
        if n < 0 or (last and d.n_rows) or (not last and d.n_rows < 1):
            raise ValueError(f"sampling groups of {[g.n_rows for g in sampling]} rows for a run of {n_rows}")
        out.append((d, slice(at, at + n)))
        at += n
    return out


def widest_logprobs(sampling: RunSampling) -> int | None:
    """The most log-probabilities any group of the run asks (None: no group asks any)."""
    ks = [d.top_logprobs for d in sampling if d.top_logprobs is not None]
    return max(ks) if ks else None
