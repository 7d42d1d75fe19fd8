"""Counters and timings of one generation (head side), printed once at the end in a fixed format.

Timing definitions follow the paper's section V.A, with wall-clock time on the head:
- prompt processing ends when the prompt's logits give the first token (t_prompt_done_s);
  prompt speed = prompt tokens / (t_prompt_done_s - t_start_s);
- TTFT = time from the end of prompt processing to the next accepted token (the token sampled from
  the prompt's logits does not count: no strategy is engaged while processing the prompt);
- ITL = mean time between consecutive accepted tokens after prompt processing (tokens accepted
  together count with a gap of 0) = (t_last_s - t_prompt_done_s) / (n_generated - 1);
- generation speed = (n_generated - 1) / (t_last_s - t_prompt_done_s) = 1 / ITL.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields


@dataclass
class Stats:
    n_prompt: int = 0              # prompt tokens
    n_cached: int = 0              # ... of them taken from the prompt cache (not decoded again)
    n_generated: int = 0           # tokens emitted
    n_runs: int = 0                # runs launched (prompt chunks included)
    n_spec_runs: int = 0           # speculative runs launched
    n_cancelled: int = 0           # speculative runs the head cancelled
    n_compactions: int = 0         # KV compactions (garbage reclaimed with nothing in flight; kvplan.py)
    n_drafted: int = 0             # draft tokens sent to the target
    n_draft_accepted: int = 0      # draft tokens the target agreed with
    n_draft_calls: int = 0         # drafter invocations (including ones that proposed nothing)
    n_siblings: int = 0            # the draft's runner-ups launched beside its chain (decide/shape.py) ...
    n_siblings_right: int = 0      # ... that verification reached and found right
    draft_at: str = "head"         # where the draft runs: head (in series) | thread | rank (draftahead.py)
    n_draft_stale: int = 0         # drafted beside the pipeline for a chain that no longer existed: dropped
    draft_link_bytes: list[int] = field(default_factory=list)  # --draft-at rank: [head -> draft, draft -> head]
    draft_levels: list[dict] = field(default_factory=list)  # drafts of drafts, per level from the one drafting for
                                   # the target down: {level, proposed, kept, calls, busy_s} (drafters/stack.py)
    accept_hist: dict[int, int] = field(default_factory=dict)  # tokens gained per verified run -> count
    draft_len_hist: dict[int, int] = field(default_factory=dict)  # draft tokens asked per micro-batch -> count
    n_kv0: int = 0                 # positions in canonical sequence 0 at the end
    t_queue_s: float = 0.0         # waited for admission (several generations at once: decide/scheduler.py)
    t_start_s: float = 0.0         # prompt processing starts
    t_prompt_done_s: float = 0.0   # the prompt's logits gave the first token
    t_first_s: float = 0.0         # first token accepted after prompt processing
    t_last_s: float = 0.0          # last token accepted
    rss_trace_mb: dict[int, float] = field(default_factory=dict)  # head RSS (MiB) every 250 generated tokens
    stage_stats: list[dict] = field(default_factory=list)  # one dict per stage rank (from worker.StageStats)
    kernels: str = ""              # --kernels (kernels.py)
    exact_batch: list = field(default_factory=list)  # exact batch limit per rank (None: not exact, --kernels fast)
    exact_batch_draft: int | None = None  # the draft model's exact batch limit (None: no draft model)

    @property
    def acceptance_rate(self) -> float:
        return self.n_draft_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def ttft_s(self) -> float:
        return self.t_first_s - self.t_prompt_done_s if self.n_generated > 1 else 0.0

    @property
    def gen_tokens_per_s(self) -> float:
        dt = self.t_last_s - self.t_prompt_done_s
        return (self.n_generated - 1) / dt if self.n_generated > 1 and dt > 0 else 0.0

    @property
    def itl_s(self) -> float:
        return (self.t_last_s - self.t_prompt_done_s) / (self.n_generated - 1) if self.n_generated > 1 else 0.0

    @property
    def pp_tokens_per_s(self) -> float:
        dt = self.t_prompt_done_s - self.t_start_s
        return (self.n_prompt - self.n_cached) / dt if dt > 0 else 0.0

    def bytes_per_token(self) -> list[float]:
        """Bytes sent per generated token on each link, rank r -> r+1 (the last: -> rank 0)."""
        return [s.get("bytes_sent", 0) / self.n_generated if self.n_generated else 0.0 for s in self.stage_stats]

    def draft_bytes_per_token(self) -> list[float]:
        """--draft-at rank: bytes per generated token on the head <-> draft rank link, [to it, back]."""
        return [b / self.n_generated for b in self.draft_link_bytes] if self.n_generated else []

    @property
    def mean_accepted_per_run(self) -> float:
        n = sum(self.accept_hist.values())
        return sum(k * v for k, v in self.accept_hist.items()) / n if n else 0.0

    def _levels_text(self) -> str:
        """What each level of a hierarchy proposed and cost: the first level's tokens went to the target (accepted:
        the line above), each level below's to the level above it."""
        parts = []
        for k, lv in enumerate(self.draft_levels):
            kept = "" if k == 0 else f", {lv['kept']} kept ({lv['kept'] / lv['proposed'] * 100:.0f}%)" \
                if lv["proposed"] else ", none kept"
            parts.append(f"{lv['level']}: {lv['proposed']} proposed{kept}, {lv['busy_s']:.2f} s")
        return "; ".join(parts)

    def _exact_text(self) -> str:
        if not self.exact_batch or None in self.exact_batch:
            return "none (not batch-invariant)"
        text = f"{min(self.exact_batch)} (per rank: {', '.join(map(str, self.exact_batch))}"
        if self.exact_batch_draft is not None:
            text += f"; draft: {self.exact_batch_draft}"
        return text + ")"

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(acceptance_rate=self.acceptance_rate, ttft_s=self.ttft_s, gen_tokens_per_s=self.gen_tokens_per_s,
                 itl_s=self.itl_s, pp_tokens_per_s=self.pp_tokens_per_s,
                 mean_accepted_per_run=self.mean_accepted_per_run, bytes_per_token=self.bytes_per_token(),
                 draft_bytes_per_token=self.draft_bytes_per_token())
        return d

    @classmethod
    def from_dict(cls, d: dict) -> Stats:
        """The Stats that to_dict gave `d` (after JSON: its derived keys dropped, the histograms' keys ints again)."""
        s = cls(**{k: v for k, v in d.items() if k in {f.name for f in fields(cls)}})
        s.accept_hist = {int(k): v for k, v in s.accept_hist.items()}
        s.draft_len_hist = {int(k): v for k, v in s.draft_len_hist.items()}
        return s

    def report(self) -> str:
        lines = [
            f"n_prompt          = {self.n_prompt}" + (f" ({self.n_cached} from the prompt cache)" if self.n_cached else ""),
            f"n_generated       = {self.n_generated}",
            f"ttft              = {self.ttft_s * 1e3:.1f} ms",
            f"prompt speed      = {self.pp_tokens_per_s:.2f} tokens/s",
            f"generation speed  = {self.gen_tokens_per_s:.2f} tokens/s",
            f"itl               = {self.itl_s * 1e3:.1f} ms",
            f"runs              = {self.n_runs} ({self.n_spec_runs} speculative, {self.n_cancelled} cancelled)",
            f"drafted/accepted  = {self.n_drafted}/{self.n_draft_accepted} "
            f"(acceptance {self.acceptance_rate * 100:.1f}%)",
            f"tokens per run    = {self.mean_accepted_per_run:.2f}",
            *([f"draft beside     = {self.draft_at}: {self.n_draft_stale} drafted tokens dropped (stale chain)"]
              if self.draft_at != "head" else []),
            *([f"draft levels      = {self._levels_text()}"] if self.draft_levels else []),
            *([f"siblings          = {self.n_siblings} launched, {self.n_siblings_right} right"]
              if self.n_siblings else []),
            *(["micro-batch sizes = " + ", ".join(f"{k} drafts x {v}" for k, v in sorted(self.draft_len_hist.items()))]
              if self.draft_len_hist else []),
            f"KV compactions    = {self.n_compactions}",
        ]
        if self.kernels:
            lines.append(f"kernels           = {self.kernels}, exact batch limit {self._exact_text()}")
        if len(self.stage_stats) > 1 and self.n_generated:
            links = [f"{s['rank']}->{(s['rank'] + 1) % len(self.stage_stats)} {b:,.0f}"
                     for s, b in zip(self.stage_stats, self.bytes_per_token())]
            if self.draft_link_bytes:
                to_draft, back = self.draft_bytes_per_token()
                links.append(f"0->draft {to_draft:,.0f}, draft->0 {back:,.0f}")
            lines.append(f"bytes/token sent  = {', '.join(links)} (per link)")
        for s in self.stage_stats[1:]:
            lines.append(f"rank {s['rank']}: decoded {s['n_decoded']} runs / {s['n_tokens']} tokens, "
                         f"cancelled {s['n_cancelled_before']} before start + {s['n_cancelled_mid']} mid-decode, "
                         f"busy {s['t_busy_s']:.2f} s, idle {s['t_idle_s']:.2f} s")
        return "\n".join(lines)


def rss_mb() -> float:
    """Current resident set size of this process in MiB (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0
