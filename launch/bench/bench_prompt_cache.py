#!/usr/bin/env python3
"""Benchmark (not a test): the prompt cache (`--cache-prompt on|off`) under a multi-turn chat load, both servers
measured in turn in one run; loopback only, bounded, stops by itself.

    python launch/bench/bench_prompt_cache.py [--conversations 4] [--turns 5] [--user-tokens 400] [--max-tokens 48]
                                              [--system-tokens 0] [--think-s 0]
                                              [--ctx auto] [--order on,off] [--deadline 1800]
                                              [--out results/bench_prompt_cache.csv] [-- SERVE ARGS...]
    python launch/bench/bench_prompt_cache.py --conversations 2 --turns 2 --user-tokens 120 --max-tokens 16  # smoke: ~2.5 min

For each of `--cache-prompt on` and `--cache-prompt off` (in --order) it starts `mpiexec -n 2 pipeinfer serve -t 1
-c CTX` (2 ranks x 1 thread: ranks x threads = the machine's 2 cores; default model qwen2.5-coder-1.5b and the
default draft, Gemma 3 270M; launch/bench/serve_load.py's start_server, on a free loopback port), then runs the same
load on it: --conversations concurrent conversations (one client thread each, the `openai` package), each of
--turns turns: send turn k (streamed, greedy: temperature 0, seed 0, --max-tokens), append the answer to its
history, send turn k+1. Every conversation starts with the same system prompt (a few hundred tokens, longer than
a 63-token prompt chunk); each user message is ~--user-tokens tokens of an excerpt of this repository's files at
HEAD (`git show HEAD:path`: deterministic for a commit; code and prose, a different file each message) and a
question about it, so a history grows to ~1,500-3,000 tokens by the last turn with the defaults.

Per turn: the time to the first streamed piece of text (TTFT), the total time, the prompt tokens (the usage
the server reports) and the answer. Printed: TTFT of turns 2+ with the cache against without (median and mean,
and their ratios), turn 1's, the completion tokens/s over the whole load (and its ratio), and a check that every
answer is identical on the two servers turn by turn (an answer depends only on its conversation's history, and
the histories hold the server's own answers, so they stay equal only if every answer is); the server's /health
`prompt_cache` numbers at the end of each load. Foreign CPU (other processes' use of the cores during a load,
launch/quiet.py's meter) is recorded: on a shared machine a load with much of it is not a clean timing.

CTX (-c) is by default big enough that every conversation's history and answer fits twice over (the cache's
entries beside the running requests, as the scheduler counts them): no request waits for cells and no entry is
dropped for room; both servers get the same value. --deadline bounds each load: no turn is sent after it
(turns not sent are reported, the check covers the turns both servers answered).

Writes OUT (one row per server, conversation and turn), OUT_summary.csv (one row per server, with the /health
numbers and the ratios), OUT.txt (the printed summary), OUT.png (TTFT per turn, both servers) and each server's
log beside OUT (OUT.server-on.log, OUT.server-off.log). Exits 1 if an answer differs or a turn failed.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/: the shared harness
from harness import ROOT, free_port, new_tag, on_path, write_csv  # noqa: E402

# this tree's pipeinfer, here and in every process started (the venv's editable install may point at another copy)
on_path("bench", pythonpath=True)
from quiet import _Meter  # noqa: E402
from serve_load import start_server, stop_server, urlopen_health  # noqa: E402

SYSTEM_PROMPT = (
    "You are a careful senior engineer reviewing a Python project that runs large language models across "
    "several machines: a pipeline of stages connected over MPI, each stage holding some of the model's layers, "
    "with a head process that schedules requests, drafts tokens with a small model and verifies them with the "
    "large one. The user will show you excerpts of the project's source code and documentation, one at a time, "
    "and ask a question about each. Answer in plain prose, briefly and precisely: name the functions, classes "
    "and options you talk about exactly as they are spelled in the excerpt, do not invent code that is not "
    "there, and say so when the excerpt does not contain enough to answer. When you point out a problem, say "
    "what input or situation triggers it and what the consequence would be. Prefer one concrete observation to "
    "several vague ones. Do not repeat the excerpt back, and do not greet the user or summarize the "
    "conversation so far; earlier excerpts in this conversation may be referred to by their file name."
)
QUESTIONS = (
    "In two sentences, what does this excerpt do?",
    "Name one edge case this code or text does not handle, and what would happen.",
    "Which function or section here would you test first, and with what input?",
    "What does the first definition in this excerpt depend on?",
    "Suggest one clearer name for an identifier here, and say why.",
    "How does this excerpt relate to the previous one you saw?",
)
DEFAULT_MODEL = "qwen2.5-coder-1.5b"


# ------------------------------------------------------------------------------------ deterministic text
def source_files(root: Path = ROOT) -> tuple[str, list[tuple[str, list[str]]]]:
    """The commit and the (path, lines) of the repository's Python sources and READMEs at HEAD, in a fixed
    shuffled order (the working tree's if git cannot tell)."""
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        names = subprocess.run(["git", "-C", str(root), "ls-tree", "-r", "--name-only", "HEAD"], capture_output=True,
                               text=True, check=True).stdout.split()

        def read(p: str) -> str:
            return subprocess.run(["git", "-C", str(root), "show", f"HEAD:{p}"], capture_output=True, text=True,
                                  check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        commit = "worktree"
        names = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]

        def read(p: str) -> str:
            return (root / p).read_text(errors="replace")
    keep = sorted(n for n in names if (n.startswith("pipeinfer/") and n.endswith(".py")) or n.endswith("README.md"))
    files = [(n, lines) for n in keep if len(lines := read(n).splitlines()) >= 20]
    random.Random(0).shuffle(files)
    return commit, files


def excerpt(tok, files: list[tuple[str, list[str]]], index: int, n_tokens: int) -> tuple[str, str]:
    """Excerpt `index`: ~n_tokens tokens of whole lines of one file (continuing into the next ones if it is too
    short), from a line that depends on the index; returns (label, text)."""
    rng = random.Random(1000 + index)
    k = index % len(files)
    path, lines = files[k]
    start = rng.randrange(0, max(1, len(lines) // 2))
    out, count, first = [], 0, (path, start + 1)
    while count < n_tokens:
        if start >= len(lines):
            k = (k + 1) % len(files)
            path, lines, start = files[k][0], files[k][1], 0
            out.append(f"# --- {path} ---")
        line = lines[start]
        out.append(line)
        count += len(tok.encode(line + "\n", add_special=False, parse_special=False))
        start += 1
    label = f"{first[0]} from line {first[1]}"
    return label, "\n".join(out)


def user_message(tok, files, index: int, turn: int, n_tokens: int) -> str:
    label, text = excerpt(tok, files, index, n_tokens)
    return f"Here is an excerpt of `{label}`:\n\n```\n{text}\n```\n\n{QUESTIONS[(index + turn) % len(QUESTIONS)]}"


def tokenizer(model: str):
    from pipeinfer.engine.models import resolve_model
    from pipeinfer.engine.tokenizer import Tokenizer
    return Tokenizer(resolve_model(model))


# ------------------------------------------------------------------------------------ the load
def converse(client, model: str, c: int, users: list[str], max_tokens: int, deadline: float, t0: float,
             rows: list[dict], lock: threading.Lock, system: str = SYSTEM_PROMPT, think_s: float = 0.0) -> None:
    """One conversation: each turn streamed, its answer appended to the history before the next turn (sent
    think_s after the answer: the user reading it)."""
    history = [{"role": "system", "content": system}]
    failed = False
    for t, user in enumerate(users):
        row = {"conversation": c, "turn": t + 1, "status": "ok", "prompt_tokens": "", "completion_tokens": "",
               "sent_s": "", "ttft_s": "", "total_s": "", "answer": "", "request_id": ""}
        if failed or time.monotonic() > deadline:
            row["status"] = "not sent (an earlier turn failed)" if failed else "not sent (deadline)"
            with lock:
                rows.append(row)
            continue
        if t and think_s:
            time.sleep(think_s)
        history.append({"role": "user", "content": user})
        parts, first, usage = [], None, None
        ts = time.perf_counter()
        try:
            stream = client.chat.completions.create(model=model, messages=history, max_tokens=max_tokens,
                                                    temperature=0.0, seed=0, stream=True,
                                                    stream_options={"include_usage": True})
            for ch in stream:
                row["request_id"] = ch.id.removeprefix("chatcmpl-")
                if ch.choices and ch.choices[0].delta.content:
                    if first is None:
                        first = time.perf_counter() - ts
                    parts.append(ch.choices[0].delta.content)
                if ch.usage:
                    usage = ch.usage
        except Exception as e:  # a failed turn ends its conversation (the history cannot go on): counted
            row["status"] = f"error: {type(e).__name__}: {e}"
            with lock:
                rows.append(row)
            failed = True
            continue
        answer = "".join(parts)
        row.update(prompt_tokens=usage.prompt_tokens if usage else "", sent_s=round(ts - t0, 3),
                   completion_tokens=usage.completion_tokens if usage else "",
                   ttft_s=round(first, 4) if first is not None else "", total_s=round(time.perf_counter() - ts, 4),
                   answer=answer)
        with lock:
            rows.append(row)
        history.append({"role": "assistant", "content": answer})


def run_server(cache: str, serve_args: list[str], log_path: Path, conversations: list[list[str]], max_tokens: int,
               deadline_s: float, system: str = SYSTEM_PROMPT, think_s: float = 0.0) -> tuple[list[dict], dict]:
    """One server (`--cache-prompt cache`), the whole load on it; its per-turn rows and its summary."""
    args = serve_args + ["--cache-prompt", cache]
    port = free_port()
    t_up = time.perf_counter()
    proc = start_server(port, args, log_path, new_tag())
    up_s = time.perf_counter() - t_up
    from openai import OpenAI
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=900)
    rows: list[dict] = []
    try:
        model = client.models.list().data[0].id
        lock = threading.Lock()
        t0 = time.perf_counter()
        deadline = time.monotonic() + deadline_s
        threads = [threading.Thread(target=converse, args=(client, model, c, users, max_tokens, deadline, t0, rows,
                                                           lock, system, think_s), daemon=True)
                   for c, users in enumerate(conversations)]
        with _Meter() as meter:
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        wall = time.perf_counter() - t0
        health = json.loads(urlopen_health(port))
    finally:
        rc = stop_server(proc)
    rows.sort(key=lambda r: (r["conversation"], r["turn"]))
    logged = server_times(log_path)
    for r in rows:
        r.update(cache_prompt=cache, serve_args=" ".join(args), **logged.get(r["request_id"], {}))
    ok = [r for r in rows if r["status"] == "ok"]
    later = [r["ttft_s"] for r in ok if r["turn"] >= 2 and r["ttft_s"] != ""]
    n_completion = sum(int(r["completion_tokens"] or 0) for r in ok)
    pc = health.get("prompt_cache") or {}
    summary = {
        "cache_prompt": cache, "serve_args": " ".join(args), "turns_ok": len(ok), "turns": len(rows),
        "load_s": round(wall, 2), "startup_s": round(up_s, 1),
        "prompt_tokens": sum(int(r["prompt_tokens"] or 0) for r in ok),
        "completion_tokens": n_completion, "tokens_per_s": round(n_completion / wall, 3),
        "ttft_turn1_median_s": median([r["ttft_s"] for r in ok if r["turn"] == 1]),
        "ttft_later_median_s": median(later),
        "ttft_later_mean_s": round(float(np.mean(later)), 4) if later else "",
        "total_later_median_s": median([r["total_s"] for r in ok if r["turn"] >= 2]),
        "server_prompt_later_median_s": median([r.get("server_prompt_s", "") for r in ok if r["turn"] >= 2]),
        "server_queued_later_median_s": median([r.get("server_queued_s", "") for r in ok if r["turn"] >= 2]),
        "foreign_cpu_pct": round(100 * meter.cpu_s / max(wall, 1e-9), 1),
        "health_cache_enabled": pc.get("enabled"), "health_cache_entries": pc.get("entries"),
        "health_cache_tokens": pc.get("tokens"), "health_cache_hits": pc.get("hits"),
        "health_cache_tokens_reused": pc.get("tokens_reused"), "health_cells_used": pc.get("cells_used"),
        "health_cells": pc.get("cells"), "health_queued": health.get("queued"), "server_exit": rc,
    }
    print(f"[--cache-prompt {cache}] {len(ok)}/{len(rows)} turns in {wall:.1f} s (server up in {up_s:.0f} s): "
          f"{n_completion} completion tokens, {summary['tokens_per_s']:.2f} tokens/s; TTFT turn 1 median "
          f"{summary['ttft_turn1_median_s']} s, turns 2+ median {summary['ttft_later_median_s']} s, mean "
          f"{summary['ttft_later_mean_s']} s; foreign CPU {summary['foreign_cpu_pct']}% of a core; "
          f"/health prompt_cache {json.dumps(pc)}", flush=True)
    return rows, summary


def server_times(log_path: Path) -> dict[str, dict]:
    """The server's own line per request (serving/answer.py): how long it queued and how long its prompt took."""
    out = {}
    for line in log_path.read_text(errors="replace").splitlines():
        m = SERVE_LINE.match(line)
        if m:
            out[m["id"]] = {"server_queued_s": float(m["queued"]), "server_prompt_s": float(m["prompt"])}
    return out


SERVE_LINE = re.compile(r"\[serve\] (?P<id>\S+): \d+ prompt \+ \d+ tokens, queued (?P<queued>[\d.]+) s, "
                        r"prompt (?P<prompt>[\d.]+) s")


# ------------------------------------------------------------------------------------ report
def compare_answers(rows: list[dict], a: str, b: str) -> tuple[int, list[str]]:
    """Turns answered by both servers, and one line per turn whose answers differ (the first differing
    character), marking each row's `same_answer`."""
    by = {(r["cache_prompt"], r["conversation"], r["turn"]): r for r in rows}
    n, bad = 0, []
    for (cache, c, t), r in sorted(by.items()):
        if cache != a:
            continue
        o = by.get((b, c, t))
        if o is None or r["status"] != "ok" or o["status"] != "ok":
            continue
        n += 1
        same = r["answer"] == o["answer"]
        r["same_answer"] = o["same_answer"] = same
        if not same:
            x, y = r["answer"], o["answer"]
            k = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            bad.append(f"conversation {c} turn {t}: answers differ from character {k}: "
                       f"{a}: {x[max(0, k - 20):k + 40]!r} / {b}: {y[max(0, k - 20):k + 40]!r}")
    return n, bad


def plot(rows: list[dict], png: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"on": "tab:blue", "off": "tab:red"}
    for cache in ("off", "on"):
        mine = [r for r in rows if r["cache_prompt"] == cache and r["status"] == "ok" and r["ttft_s"] != ""]
        if not mine:
            continue
        turns = sorted({r["turn"] for r in mine})
        for c in sorted({r["conversation"] for r in mine}):
            pts = sorted((r["turn"], r["ttft_s"]) for r in mine if r["conversation"] == c)
            ax1.plot(*zip(*pts), color=colors[cache], alpha=0.25, lw=0.8, marker=".")
        med = [float(np.median([r["ttft_s"] for r in mine if r["turn"] == t])) for t in turns]
        ax1.plot(turns, med, color=colors[cache], lw=2.2, marker="o", label=f"--cache-prompt {cache} (median)")
        ax2.scatter([r["prompt_tokens"] for r in mine], [r["ttft_s"] for r in mine], color=colors[cache], s=18,
                    label=f"--cache-prompt {cache}")
    ax1.xaxis.get_major_locator().set_params(integer=True)
    ax1.set_xlabel("turn")
    ax1.set_ylabel("time to first token (s)")
    ax1.set_title("TTFT per turn (thin: each conversation)")
    ax2.set_xlabel("prompt tokens (history)")
    ax2.set_ylabel("time to first token (s)")
    ax2.set_title("TTFT against the history's length")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_ylim(bottom=0)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def median(xs: list) -> float | str:
    xs = [x for x in xs if x != ""]
    return round(float(np.median(xs)), 4) if xs else ""


def ratio(a, b) -> float | None:
    return round(float(a) / float(b), 3) if a not in ("", None) and b not in ("", None) and float(b) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=4, help="concurrent conversations [default: 4]")
    ap.add_argument("--turns", type=int, default=5, help="turns per conversation [default: 5]")
    ap.add_argument("--user-tokens", type=int, default=400, help="tokens of excerpt per user message [default: 400]")
    ap.add_argument("--max-tokens", type=int, default=48, help="max_tokens of every answer [default: 48]")
    ap.add_argument("--ctx", default="auto", help="-c of both servers [default: auto, every conversation fits twice]")
    ap.add_argument("--order", default="on,off", help="the servers' order [default: on,off]")
    ap.add_argument("--deadline", type=float, default=1800.0, help="seconds of load per server after which no turn "
                    "is sent [default: 1800]")
    ap.add_argument("--system-tokens", type=int, default=0, help="a longer shared system prompt: the default one, "
                    "then excerpts (as an agent's tool definitions and files) up to ~N tokens [default: 0, none]")
    ap.add_argument("--think-s", type=float, default=0.0, help="seconds a user reads an answer before the next "
                    "turn (the server idles meanwhile) [default: 0]")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="for sizing the messages only (the servers' -m: SERVE ARGS)")
    ap.add_argument("--out", default=str(ROOT / "results" / "bench_prompt_cache.csv"))
    ap.add_argument("serve_args", nargs="*", help="options both servers get [default: -t 1 -c CTX]")
    args = ap.parse_args()
    order = args.order.split(",")
    if sorted(order) != ["off", "on"]:
        ap.error("--order: on,off or off,on")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    tok = tokenizer(args.model)
    commit, files = source_files()
    conversations = [[user_message(tok, files, c * args.turns + t, t, args.user_tokens) for t in range(args.turns)]
                     for c in range(args.conversations)]
    system = SYSTEM_PROMPT
    k = 0
    while len(tok.encode(system, add_special=False)) < args.system_tokens:
        system += "\n\n" + excerpt(tok, files, 10_000 + k, 300)[1]
        k += 1
    n_sys = len(tok.encode(system, add_special=False))
    n_user = [[len(tok.encode(u, add_special=False)) for u in conv] for conv in conversations]
    tok.close()
    longest = n_sys + 20 + max(sum(u + args.max_tokens + 12 for u in conv) for conv in n_user)
    ctx = (int(args.ctx) if args.ctx != "auto"
           else -(-(2 * args.conversations * (longest + args.max_tokens) + 1024) // 512) * 512)
    serve_args = args.serve_args or ["-t", "1", "-c", str(ctx)]
    print(f"load: {args.conversations} conversations x {args.turns} turns, system prompt {n_sys} tokens, user "
          f"messages {min(map(min, n_user))}-{max(map(max, n_user))} tokens (excerpts of {commit[:12]}), "
          f"max_tokens {args.max_tokens}, think time {args.think_s} s; the last turn's prompt ~{longest} tokens; servers: mpiexec -n 2 "
          f"pipeinfer serve {' '.join(serve_args)} --cache-prompt {order[0]}, then {order[1]}", flush=True)

    rows, summaries = [], {}
    for cache in order:
        r, s = run_server(cache, serve_args, out.with_suffix(f".server-{cache}.log"), conversations, args.max_tokens,
                          args.deadline, system, args.think_s)
        rows += r
        summaries[cache] = s
    n_both, bad = compare_answers(rows, "on", "off")
    on, off = summaries["on"], summaries["off"]
    r_med = ratio(on["ttft_later_median_s"], off["ttft_later_median_s"])
    r_mean = ratio(on["ttft_later_mean_s"], off["ttft_later_mean_s"])
    r_first = ratio(on["ttft_turn1_median_s"], off["ttft_turn1_median_s"])
    r_tps = ratio(on["tokens_per_s"], off["tokens_per_s"])
    r_load = ratio(on["load_s"], off["load_s"])
    for s in summaries.values():
        s.update(ratio_ttft_later_median=r_med, ratio_ttft_later_mean=r_mean, ratio_ttft_turn1_median=r_first,
                 ratio_tokens_per_s=r_tps, ratio_load_s=r_load, answers_compared=n_both, answers_differ=len(bad),
                 source_commit=commit, conversations=args.conversations, turns_asked=args.turns,
                 user_tokens=args.user_tokens, max_tokens=args.max_tokens)
    errors = [f"[--cache-prompt {r['cache_prompt']}] conversation {r['conversation']} turn {r['turn']}: {r['status']}"
              for r in rows if r["status"] != "ok"]
    r_prompt = ratio(on["server_prompt_later_median_s"], off["server_prompt_later_median_s"])
    lines = [
        f"TTFT turns 2+, cache on / off: median {on['ttft_later_median_s']} / {off['ttft_later_median_s']} s = "
        f"x{r_med}; mean {on['ttft_later_mean_s']} / {off['ttft_later_mean_s']} s = x{r_mean}",
        f"of which, in the server's log (medians, turns 2+): prompt {on['server_prompt_later_median_s']} / "
        f"{off['server_prompt_later_median_s']} s = x{r_prompt}, "
        f"queued {on['server_queued_later_median_s']} / {off['server_queued_later_median_s']} s",
        f"TTFT turn 1 (nothing cached but the system prompt), median: {on['ttft_turn1_median_s']} / "
        f"{off['ttft_turn1_median_s']} s = x{r_first}",
        f"completion tokens/s over the load, on / off: {on['tokens_per_s']} / {off['tokens_per_s']} = x{r_tps}; "
        f"load time {on['load_s']} / {off['load_s']} s = x{r_load}",
        f"prompt cache (/health at the end, cache on): {on['health_cache_hits']} hits, "
        f"{on['health_cache_tokens_reused']} tokens reused, {on['health_cache_entries']} entries holding "
        f"{on['health_cache_tokens']} tokens, cells {on['health_cells_used']}/{on['health_cells']}",
        f"answers: {n_both - len(bad)}/{n_both} turns identical on the two servers"
        + (f"; {len(bad)} differ" if bad else ""),
        f"foreign CPU during the loads (% of a core): on {on['foreign_cpu_pct']}, off {off['foreign_cpu_pct']}",
    ] + bad + errors
    print("\n".join(lines))

    for r in rows:
        for k in ("same_answer", "server_queued_s", "server_prompt_s"):
            r.setdefault(k, "")
    cols = ["cache_prompt", "conversation", "turn", "status", "prompt_tokens", "completion_tokens", "sent_s", "ttft_s",
            "total_s", "server_queued_s", "server_prompt_s", "same_answer", "answer", "request_id", "serve_args"]
    write_csv(out, rows, cols)
    summary_csv = out.with_name(out.stem + "_summary.csv")
    with open(summary_csv, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["timestamp"] + list(on))
        w.writeheader()
        for s in summaries.values():
            w.writerow({"timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"), **s})
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    plot(rows, out.with_suffix(".png"),
         f"pipeinfer serve, 2 ranks x 1 thread, {args.conversations} conversations x {args.turns} turns, "
         f"~{args.user_tokens}-token messages, {args.max_tokens}-token answers\nTTFT turns 2+ with the prompt "
         f"cache / without: x{r_med} (median), x{r_mean} (mean); answers identical: {n_both - len(bad)}/{n_both}")
    print(f"wrote {out}, {summary_csv}, {out.with_suffix('.txt')}, {out.with_suffix('.png')}")
    if bad or errors or any(s["server_exit"] not in (0, None) for s in summaries.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
