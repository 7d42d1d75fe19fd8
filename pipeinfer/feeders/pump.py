"""The one pump between a front end and the generation loop: requests from a queue into rank 0's scheduler
(ranks/scheduler.py), which it steps until every admitted request is answered. The HTTP server's generation thread
(generator.Generator) and the attached rank 0 of a supervised job (attach.py) both run it; `generate` runs the scheduler directly."""
from __future__ import annotations

import queue
import time
from typing import Callable

TICK_S = 0.5  # with a tick, a pump that waits for a request wakes this often (rank 0 takes its stages' reports)
_NOTHING = object()  # what the inbox gave when it gave nothing (None is an item: the generator's end)


def pump(sched, inbox: queue.Queue, admit: Callable[[object], None], *,
         ends: Callable[[object], bool] = lambda item: item is None,
         stop_requested: Callable[[], bool] = lambda: False,
         tick: Callable[[float], None] | None = None) -> None:
    """Step `sched` with what arrives in `inbox` until an item that `ends` it (then what was admitted is finished)
    or a stop is requested. An item is taken only while the scheduler has no request of its own waiting, so the
    rest wait in the inbox, whose bound is the server's queue limit; with nothing to generate it gives the scheduler
    its idle work (Scheduler.idle_work: the prompt cache's last answers in whole chunks), then blocks there.
    tick(waited_s), where given, runs before every step (waited_s 0) and, while the pump waits for a request, at
    least every TICK_S with the seconds it waited (HeadSession.poll_stages: the stages' reports, rank 0's idle time)."""
    stopping = False
    while True:
        while not stopping and not sched.waiting:
            block = not sched.busy and not sched.has_idle_work()
            t0 = time.perf_counter()
            try:
                item = inbox.get(block=block, timeout=TICK_S if block and tick is not None else None)
            except queue.Empty:
                item = _NOTHING
            if block and tick is not None:
                tick(time.perf_counter() - t0)
            if item is _NOTHING:
                if block:
                    continue  # a tick's wake-up: wait on
                break
            if ends(item):
                stopping = True
            else:
                admit(item)
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
