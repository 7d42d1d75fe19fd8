"""The one pump between a front end and the generation loop: requests from a queue into rank 0's scheduler
(ranks/scheduler.py), which it steps until every admitted request is answered. The HTTP server (app.Generator)
and the attached rank 0 of a supervised job (attach.py) both run it; `generate` runs the scheduler directly."""
from __future__ import annotations

import queue
from typing import Callable


def pump(sched, inbox: queue.Queue, admit: Callable[[object], None], *,
         ends: Callable[[object], bool] = lambda item: item is None,
         stop_requested: Callable[[], bool] = lambda: False) -> None:
    """Step `sched` with what arrives in `inbox` until an item that `ends` it (then what was admitted is finished)
    or a stop is requested. An item is taken only while the scheduler has no request of its own waiting, so the
    rest wait in the inbox, whose bound is the server's queue limit; with nothing to generate it gives the scheduler
    its idle work (Scheduler.idle_work: the prompt cache's last answers in whole chunks), then blocks there."""
    stopping = False
    while True:
        while not stopping and not sched.waiting:
            try:
                item = inbox.get(block=not sched.busy and not sched.has_idle_work())
            except queue.Empty:
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
        sched.step()
