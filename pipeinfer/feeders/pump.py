"""The one pump between a front end and the generation loop: rank 0's scheduler (decide/scheduler.py) stepped until
every admitted request is answered, taking a feeder's next request whenever the scheduler has room to wait for
one. The HTTP server's generation thread (generator.Generator) and the attached rank 0 of a supervised job
(attach.py) both run it; `generate` runs the scheduler directly.

A feeder keeps its own inbox and hands the pump only `take(timeout_s)`: take the next request in (made into the
scheduler's Request and submitted by the feeder itself) and say TOOK, or NOTHING by the timeout, or END. A request
never passes through the pump: it goes from the feeder to the session and the scheduler in one move.
"""
from __future__ import annotations

import time
from typing import Callable

TICK_S = 0.5  # with a tick, a pump that waits for a request wakes this often (rank 0 takes its stages' reports)
TOOK, NOTHING, END = "took", "nothing", "end"  # what a feeder's take did: a request in; none came; no more will come


def pump(sched, take: Callable[[float | None], str], *, stop_requested: Callable[[], bool] = lambda: False,
         tick: Callable[[float], None] | None = None) -> None:
    """Step `sched`, taking the feeder's requests (`take(timeout_s)`: 0, do not wait; None, wait as long as it
    takes) until it says END (then what was admitted is finished) or a stop is requested. A request is taken only
    while the scheduler has no request of its own waiting, so the rest wait in the feeder's inbox, whose bound is
    the server's queue limit; with nothing to generate it gives the scheduler its idle work (Scheduler.idle_work:
    the prompt cache's last answers in whole chunks), then blocks in `take`. tick(waited_s), where given, runs
    before every step (waited_s 0) and, while the pump waits for a request, at least every TICK_S with the seconds
    it waited (HeadSession.poll_stages: the stages' reports, rank 0's idle time)."""
    stopping = False
    while True:
        while not stopping and not sched.waiting:
            block = not sched.busy and not sched.has_idle_work()
            t0 = time.perf_counter()
            took = take((TICK_S if tick is not None else None) if block else 0)
            if block and tick is not None:
                tick(time.perf_counter() - t0)
            if took == NOTHING:
                if block:
                    continue  # a tick's wake-up: wait on
                break
            if took == END:
                stopping = True
        if stop_requested():
            stopping = True
        if not sched.busy:
            if stopping:
                return
            if not sched.idle_work():
                continue
        if tick is not None:
            tick(0.0)
        sched.step()
