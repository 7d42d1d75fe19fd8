"""GET /metrics: the server's counters in Prometheus' text format (prometheus-client, a registry of the app's own),
named `pipeinfer:...` as vLLM's `vllm:` and llama-server's `llamacpp:`.

Where the numbers come from, at no cost per token:
- each finished generation's Stats (core/metrics.Stats), once, in the callback the generation thread (or the
  supervisor) calls as the job finishes (`job_done`, chained to the generator's on_done): tokens, the draft's
  tokens and acceptance, runs and cancelled runs, time to first token, inter-token latency, end to end;
- each HTTP answer's route and status, counted by access.Gate (requests, errors, refusals);
- at scrape time, what /health reads (generator.load(): generating, queued, runs in flight, KV partitions, the
  batching counters (decodes shared by several requests, their rows, draft micro-batches riding them); the
  prompt cache's entries, tokens, hits and tokens reused and the KV cells in use, `prompt_cache`: a supervised
  server's as rank 0 last reported them; the supervisor's re-forms and lost hosts) and the stages (rank, host,
  layers) where rank 0 knows them;
- each stage's counters by rank and host (load()["stages"]: what the stage last reported to rank 0, at most a
  second old (protocol.StageReport; rank 0's own stage counted by rank 0): time in llama_decode, time waiting for
  work, runs decoded and their batch tokens, runs cancelled before they started and mid-decode, bytes it sent on.
  A supervised server's add the jobs before a re-form to the current job's (supervisor/health.StageTotals), so they never
  go backwards; a stage of a job that is gone keeps its last total.

Latencies follow vLLM: time_to_first_token_seconds from the request's arrival to its first token (its wait for
admission, the prompt's processing and the way back: serving.job.time_to_first_token_s, what the request log says);
inter_token_latency_seconds one observation per request, its mean gap between tokens after the first
(Stats.itl_s); e2e_request_latency_seconds from the request's arrival to its last token.
"""
from __future__ import annotations

import socket
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..serving.job import time_to_first_token_s

P = "pipeinfer:"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
                   160.0, 640.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
REFUSED = {401: "unauthorized", 413: "body_too_large", 503: "overloaded"}


class ServerMetrics:
    """The app's metrics over `generator` (feeders/generator.Generator, or the supervisor)."""

    def __init__(self, generator):
        self.generator = generator
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.cached_tokens = Counter(P + "prompt_tokens_cached", "Prompt tokens of finished generations taken "
                                     "from the prompt cache (not computed again)", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(P + "requests", "HTTP requests answered, by route and status", ["route", "status"],
                                registry=r)
        self.errors = Counter(P + "request_errors", "HTTP requests answered with a server error (5xx but 503)",
                              registry=r)
        self.rejected = Counter(P + "requests_rejected", "Requests refused before any work: 401 unauthorized, "
                                "413 body_too_large, 503 overloaded (queue full, too many at once, pipeline down)",
                                ["reason"], registry=r)
        self.finished = Counter(P + "request_success", "Generations finished, by finish reason (stop, length, "
                                "cancelled: the client left)", ["finished_reason"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "From a generation's arrival to its first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Each generation's mean time between tokens after "
                             "the first", buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "From a generation's arrival to its end",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.drafted = Counter(P + "draft_tokens", "Draft tokens sent to the target for verification", registry=r)
        self.accepted = Counter(P + "accepted_draft_tokens", "Draft tokens the target agreed with", registry=r)
        self.runs = Counter(P + "runs", "Runs launched into the pipeline (prompt chunks included)", registry=r)
        self.spec_runs = Counter(P + "speculative_runs", "Speculative runs launched", registry=r)
        self.cancelled_runs = Counter(P + "cancelled_runs", "Speculative runs the head cancelled", registry=r)
        self.acceptance = Gauge(P + "acceptance_ratio", "accepted_draft_tokens_total / draft_tokens_total",
                                registry=r)
        # drafts of drafts (drafters/stack.py), by level: the first level's tokens go to the target, a lower one's
        # to the level above it (kept: those it agreed with)
        self.level_proposed = Counter(P + "draft_level_proposed_tokens", "Tokens each level of a draft hierarchy "
                                      "proposed to the level above it", ["level"], registry=r)
        self.level_kept = Counter(P + "draft_level_kept_tokens", "Tokens of a lower level that the level above it "
                                  "agreed with", ["level"], registry=r)
        self.level_busy = Counter(P + "draft_level_busy_seconds", "Each level's own drafting time", ["level"],
                                  registry=r)
        self._n_drafted = self._n_accepted = 0
        r.register(_Now(generator))

    # ---------------------------------------------------------------- hooks
    def attach(self, generator) -> None:
        """Count every job `generator` finishes (its on_done chained; read at call time by Answer.finish)."""
        before = getattr(generator, "on_done", None)

        def on_done(job, stats, finish, *more):
            self.job_done(job, stats, finish)
            if before is not None:
                before(job, stats, finish, *more)
        generator.on_done = on_done

    def job_done(self, job, stats, finish: str) -> None:
        """One finished generation (the generation thread; counters only)."""
        self.prompt_tokens.inc(len(job.prompt_tokens))
        self.cached_tokens.inc(stats.n_cached)
        self.generation_tokens.inc(stats.n_generated)
        self.finished.labels(finish).inc()
        if stats.n_drafted:
            self.drafted.inc(stats.n_drafted)
            self.accepted.inc(stats.n_draft_accepted)
            self._n_drafted += stats.n_drafted
            self._n_accepted += stats.n_draft_accepted
            self.acceptance.set(self._n_accepted / self._n_drafted)
        for level in stats.draft_levels:
            self.level_proposed.labels(level["level"]).inc(level["proposed"])
            self.level_kept.labels(level["level"]).inc(level["kept"])
            self.level_busy.labels(level["level"]).inc(level["busy_s"])
        self.runs.inc(stats.n_runs)
        self.spec_runs.inc(stats.n_spec_runs)
        self.cancelled_runs.inc(stats.n_cancelled)
        if job.t_first_token_s:
            self.ttft.observe(time_to_first_token_s(job))
        if stats.n_generated > 1:
            self.itl.observe(stats.itl_s)
        self.e2e.observe(max(0.0, time.perf_counter() - job.t_queued_s))

    def answered(self, route: str, status: int) -> None:
        """One HTTP answer (access.Gate)."""
        self.requests.labels(route, str(status)).inc()
        if status in REFUSED:
            self.rejected.labels(REFUSED[status]).inc()
        elif status >= 500:
            self.errors.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Now:
    """What /health reads, at scrape time."""

    def __init__(self, generator):
        self.generator = generator

    def describe(self):
        return []

    def collect(self):
        g = self.generator
        try:
            load = g.load()
        except Exception:  # a snapshot read from another thread (or none): a scrape must never fail
            load = {}
        yield _gauge("requests_generating", "Generations in progress", load.get("generating"))
        yield _gauge("requests_queued", "Generations waiting for admission", load.get("queued"))
        yield _gauge("pipeline_up", "1 while the pipeline serves, 0 once it failed",
                     0 if getattr(g, "fatal", None) else 1)
        yield _gauge("runs_in_flight", "Runs in the pipeline now", load.get("runs_in_flight"))
        used = (load["partitions"] - load["partitions_free"]) if load.get("partitions") else None
        yield _gauge("kv_partitions_used", "KV-cache partitions held by generations", used)
        yield _gauge("kv_partitions", "KV-cache partitions in all", load.get("partitions") or None)
        yield from _prompt_cache(load.get("prompt_cache"))
        yield from _batching(load.get("batching"))
        if "reforms" in load:  # the supervisor
            reforms = CounterMetricFamily(P + "reforms", "Times the supervised pipeline was re-formed")
            reforms.add_metric([], load["reforms"])
            yield reforms
            yield _gauge("lost_hosts", "Ranks (hosts) lost and not back", len(load.get("lost") or ()))
            down = CounterMetricFamily(P + "down_seconds", "Seconds the supervised server had no serving pipeline "
                                       "after it first served (re-forms and re-plans)")
            down.add_metric([], load.get("down_s", 0.0))
            yield down
        stages = GaugeMetricFamily(P + "stage_layers", "Layers each stage rank holds (-1: not known here)",
                                   labels=["rank", "host"])
        for rank, host, layers in _stages(g):
            stages.add_metric([str(rank), host], layers)
        yield stages
        yield from stage_counters(load.get("stages") or [])


STAGE_FAMILIES = (  # (name, StageReport counter, help)
    ("stage_busy_seconds", "t_busy_s", "Time each stage spent inside llama_decode"),
    ("stage_idle_seconds", "t_idle_s", "Time each stage waited for work (a transaction; rank 0: a result or a "
                                       "request)"),
    ("stage_decodes", "n_decoded", "Runs each stage decoded to the end"),
    ("stage_batch_tokens", "n_tokens", "Tokens in the batches of the runs each stage decoded"),
    ("link_sent_bytes", "bytes_sent", "Bytes each rank sent on the pipeline (stage r to r+1, the last one to rank "
                                      "0; rank 0's cancellations to the last one), reports not counted"),
)


def stage_counters(stages: list[dict]):
    """The stages' counter families, one sample per (rank, host) of `stages` (HeadSession.stages' shape)."""
    for name, key, doc in STAGE_FAMILIES:
        family = CounterMetricFamily(P + name, doc, labels=["rank", "host"])
        for st in stages:
            family.add_metric([str(st["rank"]), st["host"]], st[key])
        yield family
    cancelled = CounterMetricFamily(P + "stage_cancelled", "Speculative runs each stage did not finish: cancelled "
                                    "before it started them (before) or aborted mid-decode (mid)",
                                    labels=["rank", "host", "when"])
    for st in stages:
        cancelled.add_metric([str(st["rank"]), st["host"], "before"], st["n_cancelled_before"])
        cancelled.add_metric([str(st["rank"]), st["host"], "mid"], st["n_cancelled_mid"])
    yield cancelled


def _gauge(name: str, doc: str, value):
    family = GaugeMetricFamily(P + name, doc)
    if value is not None:
        family.add_metric([], value)
    return family


BATCHING_FAMILIES = (  # (name, HeadSession.load()["batching"] key, help)
    ("shared_decodes", "shared_decodes", "Runs that carried several requests' rows (users batched into one decode)"),
    ("shared_rows", "shared_rows", "Rows those shared runs carried"),
    ("draft_rides", "draft_rides", "Draft micro-batches that rode other requests' shared decodes"),
    ("riders_dropped", "riders_dropped", "Riding draft micro-batches cancelled while their shared decode was in "
                                         "flight: their rows dropped at the head, the decode not aborted"),
)


def _batching(batching: dict | None):
    """The scheduler's batching counters (/health's `batching`; none from a supervised server's load)."""
    if not isinstance(batching, dict):
        return
    yield _gauge("batch_rows", "Rows of different requests one decode may carry (--batch-rows)",
                 batching.get("batch_rows"))
    for name, key, doc in BATCHING_FAMILIES:
        family = CounterMetricFamily(P + name, doc)
        family.add_metric([], batching.get(key, 0))
        yield family


def _prompt_cache(cache: dict | None):
    """The prompt cache and the KV cells (Scheduler.cache_load), as /health has them (no samples without)."""
    c = cache if isinstance(cache, dict) else {}
    yield _gauge("prompt_cache_entries", "Prompts the prompt cache holds", c.get("entries"))
    yield _gauge("prompt_cache_tokens", "Tokens the prompt cache holds", c.get("tokens"))
    yield _gauge("kv_cells_used", "KV cells held: generations, the prompt cache, and cells not yet reclaimed",
                 c.get("cells_used"))
    yield _gauge("kv_cells", "KV cells in all (the context size)", c.get("cells"))
    for name, key, doc in (("prompt_cache_hits", "hits", "Requests that started from the prompt cache"),
                           ("prompt_cache_tokens_reused", "tokens_reused",
                            "Prompt tokens taken from the prompt cache (counted at admission; a supervised "
                            "pipeline's since its rank 0 last started)")):
        family = CounterMetricFamily(P + name, doc)
        if c.get(key) is not None:
            family.add_metric([], c[key])
        yield family


def _stages(g) -> list[tuple[int, str, int]]:
    """(rank, host, layers) of each stage rank, from what rank 0 has: the session's layer ranges and the liveness
    channel's hosts (mpiexec), or the supervisor's slots."""
    session = getattr(g, "session", None)
    ranges = getattr(session, "ranges", None)
    if ranges:
        live = getattr(session, "live", None)
        hosts = [h[0] for h in getattr(live, "hosts", None) or []]
        hosts = hosts or [socket.gethostname()] + [""] * (len(ranges) - 1)
        return [(r, hosts[r] if r < len(hosts) else "", x.n_layers) for r, x in enumerate(ranges)]
    slots = getattr(g, "slots", None)
    if isinstance(slots, list):
        return [(r, str(h), -1) for r, h in enumerate(slots)]
    return []


def register_metrics(app, generator) -> ServerMetrics:
    """GET /metrics on `app`; the jobs `generator` finishes are counted."""
    from fastapi.responses import Response
    metrics = ServerMetrics(generator)
    metrics.attach(generator)

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
    return metrics
