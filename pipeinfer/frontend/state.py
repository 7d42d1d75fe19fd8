"""The cluster's state as the web page (page.py) shows it: GET /state's JSON, assembled from what rank 0's process
already knows, with no MPI traffic of its own.

    cluster   hosts, each with its ranks: layer range [start, end), threads, pid, where the draft runs; a lost rank
              (a supervised server's lost slot) greyed with the reason. Direct (`serve` under mpiexec): from the
              HeadSession (its ranges, threads, liveness's (host, pid) per rank, the configuration's draft_at).
              Supervised (`serve --np N`): from rank 0's Ready (link.py: ranks_at, layers, threads) of the current
              job, and the supervisor's slots, lost slots, phase and re-forms.
    load      generator.load() (/health's): queued, generating, runs in flight (direct only), partitions
    activity  tokens/s (the tokens streamed to clients over the last few seconds, counted as they go out: Meter),
              a per-second history, acceptance of the last finished requests, the recent requests
    events    the supervisor's log lines about lost ranks, re-forms and re-plans (and a fatal error), timestamped
    busy      each stage's busy share over the last BUSY_WINDOW_S (BusyWindow: busy / (busy + idle) between this
              reading of generator.load()["stages"] and one about that old), also on each rank of the cluster with
              its counters (`stage`: runs, batch tokens, cancellations, busy and idle seconds, bytes sent). The
              counters are what each stage last reported to rank 0 (at most a second old: protocol.StageReport);
              rank 0 counts its own, its idle time being its wait for a result or a request.

Meter's counters come from answer.Answer (every job the app submits carries the meter: ClusterState.install), on
the generation thread (direct) or the supervisor's reader: a lock guards them.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque

from ..serving.job import time_to_first_token_s

BUSY_WINDOW_S = 5.0
BUSY_NOTE = (f"busy share: time in llama_decode / (that + time waiting for work), over the last "
             f"{BUSY_WINDOW_S:.0f} s of each stage's own counts (reported once a second); rank 0 waits for a result "
             f"or a request")
_EVENT_WORDS = ("re-form", "re-plan", "was lost", "answer(s) again", "fatal")
STAGE_SHOWN = ("n_decoded", "n_tokens", "n_cancelled_before", "n_cancelled_mid", "t_busy_s", "t_idle_s", "bytes_sent")


def busy_share(old: dict | None, new: dict) -> float | None:
    """busy / (busy + idle) of one stage between two readings of its counters (old None: since it started; a new
    job's counters below the old ones: since that job started); None where neither grew."""
    busy, idle = new["t_busy_s"], new["t_idle_s"]
    if old is not None and busy >= old["t_busy_s"] and idle >= old["t_idle_s"]:
        busy, idle = busy - old["t_busy_s"], idle - old["t_idle_s"]
    return round(busy / (busy + idle), 3) if busy + idle > 0 else None


class BusyWindow:
    """Readings of the stages' counters as /state takes them; each stage's busy share between the reading now and
    the newest one at least window_s old (or the oldest there is: a shorter window, at first; none: since the start).
    Thread-safe."""

    def __init__(self, window_s: float = BUSY_WINDOW_S, max_readings: int = 256):
        self.window_s = window_s
        self._lock = threading.Lock()
        self._readings: deque[tuple[float, dict]] = deque(maxlen=max_readings)  # (time, {(rank, host): counters})

    def shares(self, stages: list[dict], now: float) -> dict[tuple[int, str], float | None]:
        new = {(st["rank"], st["host"]): st for st in stages}
        with self._lock:
            while len(self._readings) >= 2 and self._readings[1][0] <= now - self.window_s:
                self._readings.popleft()
            old = self._readings[0][1] if self._readings else {}
            self._readings.append((now, new))
        return {key: busy_share(old.get(key), st) for key, st in new.items()}


class Meter:
    """Tokens streamed and requests finished, for the page's numbers (thread-safe)."""

    def __init__(self, window_s: float = 3.0, history_s: int = 60, clock=time.monotonic):
        self.window_s, self.history_s, self.clock = window_s, history_s, clock
        self._lock = threading.Lock()
        self._events: deque[tuple[float, int]] = deque()     # (time, tokens) within the window
        self._seconds: deque[list[int]] = deque()            # [whole second, tokens] of the last history_s seconds
        self.n_tokens = 0
        self.n_done = 0
        self.recent: deque[dict] = deque(maxlen=20)           # the last finished requests, newest last
        self._drafted: deque[tuple[int, int]] = deque(maxlen=20)  # (drafted, accepted) of the same

    def on_tokens(self, n: int) -> None:
        now = self.clock()
        with self._lock:
            self.n_tokens += n
            self._events.append((now, n))
            sec = int(now)
            if self._seconds and self._seconds[-1][0] == sec:
                self._seconds[-1][1] += n
            else:
                self._seconds.append([sec, n])
            self._trim(now)

    def on_done(self, job, stats, finish: str) -> None:
        row = {"id": job.request_id, "prompt_tokens": len(job.prompt_tokens), "tokens": stats.n_generated,
               "tokens_per_s": round(stats.gen_tokens_per_s, 2), "ttft_s": round(time_to_first_token_s(job), 3),
               "acceptance": round(stats.acceptance_rate, 3) if stats.n_drafted else None, "finish": finish,
               "at": time.time()}
        with self._lock:
            self.n_done += 1
            self.recent.append(row)
            self._drafted.append((stats.n_drafted, stats.n_draft_accepted))

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self.window_s:
            self._events.popleft()
        while self._seconds and self._seconds[0][0] < int(now) - self.history_s:
            self._seconds.popleft()

    def snapshot(self) -> dict:
        now = self.clock()
        with self._lock:
            self._trim(now)
            rate = sum(n for _, n in self._events) / self.window_s
            per_second = dict((s, n) for s, n in self._seconds)
            drafted = sum(d for d, _ in self._drafted)
            accepted = sum(a for _, a in self._drafted)
            recent = list(self.recent)
            n_tokens, n_done = self.n_tokens, self.n_done
        sec = int(now)  # the history: whole seconds, oldest first, the one under way left out
        history = [per_second.get(s, 0) for s in range(sec - self.history_s, sec)]
        return {"tokens_per_s": round(rate, 2), "tokens_total": n_tokens, "requests_done": n_done,
                "acceptance": round(accepted / drafted, 3) if drafted else None,
                "drafted": drafted, "accepted": accepted, "history": history,
                "recent": recent[::-1][:8]}


# ------------------------------------------------------------------------------------ the cluster
def _rank(rank: int, host: str, pid: int | None, layers=None, threads=None, role: str = "target") -> dict:
    return {"rank": rank, "host": host, "pid": pid, "layers": list(layers) if layers is not None else None,
            "threads": threads, "role": role, "head": rank == 0, "draft": None, "lost": False, "reason": None,
            "stage": None}


def _draft(config, ranks: list[dict], n_target: int) -> dict | None:
    """Where the draft runs (marked on its rank): None in iterative mode."""
    if config is None or getattr(config, "mode", None) == "iterative":
        return None
    options = config.draft
    at = options.at
    kind = os.path.basename(options.model) if options.drafter == "model" and options.model else options.drafter
    rank = len(ranks) - 1 if at == "rank" and len(ranks) > n_target else 0
    threads = options.threads or (ranks[0]["threads"] if at != "rank" and ranks else None)
    where = {"head": "in series on rank 0", "thread": "beside the pipeline on rank 0 (a thread)",
             "rank": f"its own rank ({rank})"}.get(at, at)
    draft = {"at": at, "rank": rank, "kind": kind, "threads": threads, "where": where}
    if ranks:
        ranks[rank]["draft"] = draft
        if at == "rank" and rank >= n_target:
            ranks[rank]["role"] = "draft"
            ranks[rank]["threads"] = threads
    return draft


def _direct(session) -> dict:
    """A pipeline under mpiexec: its HeadSession."""
    from ..wire.hosts import host_name
    ranges = list(getattr(session, "ranges", None) or [])
    threads = list(getattr(session, "threads", None) or [])
    live = getattr(session, "live", None)
    hosts = list(live.hosts) if live is not None else [(host_name(), os.getpid())] if ranges else []
    mem = list(getattr(live, "mem_available", None) or []) if live is not None else []
    ranks = [_rank(r, h, pid, (ranges[r].start, ranges[r].end) if r < len(ranges) else None,
                   threads[r] if r < len(threads) else None) for r, (h, pid) in enumerate(hosts)]
    config = getattr(session, "config", None)
    draft = _draft(config, ranks, len(ranges))
    return {"ranks": ranks, "n_target": len(ranges), "mem": dict(zip((h for h, _ in hosts), mem)),
            "mode": getattr(config, "mode", None), "draft": draft, "stale": False}


def _local(host: str) -> str:
    """A hostfile's name for this machine as its ranks name it (liveness: the hostname)."""
    import socket

    from ..wire.hosts import host_name
    return host_name() if host in ("localhost", "127.0.0.1", socket.gethostname()) else host


def _supervised(sup) -> dict:
    """A supervised server: the current job as its rank 0 reported it when it attached, and the lost slots."""
    ready = sup.ready
    try:
        config = sup.job_config()
    except Exception:  # noqa: BLE001 (a page must not fail on a supervisor between states)
        config = sup.config
    if ready is not None:
        layers, threads = list(ready.layers or []), list(ready.threads or [])
        ranks = [_rank(r, h, pid, layers[r] if r < len(layers) else None, threads[r] if r < len(threads) else None)
                 for r, (h, pid) in enumerate(ready.ranks_at)]
        n_target, mem = ready.ranks, dict(zip((h for h, _ in ready.ranks_at), ready.mem_available))
    else:  # not attached yet: the slots, nothing known of them
        ranks = [_rank(r, _local(h), None) for r, h in enumerate(sup.job_hosts())]
        n_target, mem = len(sup.slots), {}
    draft = _draft(config, ranks, n_target)
    for _place, (host, label) in sorted(sup.lost_slots.items()):
        lost = _rank(-1, _local(host), None)
        lost.update(rank=None, lost=True, reason=label, role="lost")
        ranks.append(lost)
    return {"ranks": ranks, "n_target": n_target, "mem": mem, "mode": getattr(config, "mode", None),
            "draft": draft, "stale": sup.phase != "serving"}


def _hosts(ranks: list[dict], mem: dict) -> list[dict]:
    """The ranks grouped by host, in rank order (a lost slot under its host: greyed; a host with only lost slots:
    lost)."""
    hosts: dict[str, dict] = {}
    for r in ranks:
        h = hosts.setdefault(r["host"], {"name": r["host"], "ranks": [], "lost": False, "reason": None,
                                         "mem_gib": round(mem[r["host"]] / 2**30, 1) if r["host"] in mem else None})
        h["ranks"].append(r)
    for h in hosts.values():
        if all(r["lost"] for r in h["ranks"]):
            h["lost"], h["reason"] = True, "; ".join(r["reason"] for r in h["ranks"])
    return list(hosts.values())


class ClusterState:
    """GET /state for one app: its generator (feeders/generator.Generator or the supervisor), its meter, its event log."""

    def __init__(self, cfg, generator):
        self.cfg, self.generator, self.meter = cfg, generator, Meter()
        self.events: deque[dict] = deque(maxlen=40)
        self.busy = BusyWindow()
        self.t_start = time.time()

    def install(self) -> None:
        """Every job submitted from now on carries the meter (answer.Answer counts through it); the supervisor's
        (or generator's) log lines about lost ranks and re-forms are kept for the page."""
        gen, meter = self.generator, self.meter
        submit = gen.submit

        def submit_metered(job) -> None:
            if job.meter is None:
                job.meter = meter
            submit(job)
        gen.submit = submit_metered
        log = getattr(gen, "log", None)
        if callable(log):
            def log_tapped(msg: str) -> None:
                if any(w in msg for w in _EVENT_WORDS):
                    self.events.append({"at": time.time(), "line": msg.removeprefix("[serve] ")})
                log(msg)
            gen.log = log_tapped

    def cluster(self) -> dict:
        gen = self.generator
        if hasattr(gen, "slots") and hasattr(gen, "ready"):
            view, supervised = _supervised(gen), True
        elif getattr(gen, "session", None) is not None:
            view, supervised = _direct(gen.session), False
        else:
            view, supervised = {"ranks": [], "n_target": 0, "mem": {}, "mode": None, "draft": None, "stale": False}, False
        n_layers = max((r["layers"][1] for r in view["ranks"] if r["layers"]), default=None)
        return {"supervised": supervised, "hosts": _hosts(view["ranks"], view.pop("mem")), "n_layers": n_layers,
                **view}

    def snapshot(self) -> dict:
        gen = self.generator
        fatal = getattr(gen, "fatal", None)
        try:
            load = dict(gen.load())
        except Exception as e:  # noqa: BLE001 (a snapshot read from another thread; the page shows why)
            load = {"error": f"{type(e).__name__}: {e}"}
        lost = list(getattr(gen, "lost", []) or [])
        status = "error" if fatal else "degraded" if lost or load.get("degraded") else "ok"
        cluster = self.cluster()
        busy = self._stages(cluster, load.get("stages") or [])
        n_ranks = len([r for r in cluster["ranks"] if not r["lost"]])
        return {
            "time": time.time(), "uptime_s": round(time.time() - self.t_start, 1),
            "model": self.cfg.model_id, "n_ctx": self.cfg.n_ctx, "status": status, "error": fatal,
            "phase": getattr(gen, "phase", "serving"), "parallel": getattr(gen, "parallel", None),
            "cluster": cluster, "n_ranks": n_ranks, "lost": lost, "reforms": getattr(gen, "n_reforms", 0),
            "load": {"queued": load.get("queued"), "generating": load.get("generating"),
                     "runs_in_flight": load.get("runs_in_flight"), "partitions_free": load.get("partitions_free"),
                     "partitions": load.get("partitions"), "prompt_cache": load.get("prompt_cache")},
            "activity": self.meter.snapshot(),
            "events": list(self.events)[::-1],
            "busy": busy, "busy_note": BUSY_NOTE,
        }

    def _stages(self, cluster: dict, stages: list[dict]) -> list[dict] | None:
        """Each rank of the cluster gets its stage's counters and busy share (`stage`, None where there are none);
        the busy shares of the cluster's stages, rank order (None: no stage reported yet)."""
        shares = self.busy.shares(stages, time.monotonic())
        by_key = {(st["rank"], st["host"]): st for st in stages}
        busy = []
        for r in cluster["ranks"]:
            st = None if r["lost"] else by_key.get((r["rank"], r["host"]))
            r["stage"] = None if st is None else {**{k: st[k] for k in STAGE_SHOWN},
                                                  "busy_share": shares[(r["rank"], r["host"])]}
            if st is not None:
                busy.append({"rank": r["rank"], "host": r["host"], "busy_share": r["stage"]["busy_share"]})
        return busy or None
