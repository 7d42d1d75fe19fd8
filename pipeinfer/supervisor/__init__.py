"""The supervisor: a process outside the MPI job that starts it, re-forms it without a lost host and resumes what
was in flight (`serve --np N` / `--hostfile`, `generate --np N`).

supervisor (the Supervisor, coordinating the rest: the front end's generator), placement and slots (where the job
runs, and the slots it lost), lifecycle (the job's launches and restarts) over child (one launch's process), launch
(the launcher's command lines) and failures (what a job's end says: the rank lost), inflight (the requests not
answered yet, resumed on each new job), health (what /health and the live page say) and resume (`generate --np`:
one answer, or a file of prompts, that survives a lost rank). Imports the serving seam and the wire; the command line
imports it.
"""
