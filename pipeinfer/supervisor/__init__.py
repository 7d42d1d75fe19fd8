"""The supervisor: a process outside the MPI job that starts it, re-forms it without a lost host and resumes what
was in flight (`serve --np N` / `--hostfile`, `generate --np N`).

supervisor (the job started, watched and re-formed; the placement and re-plan of ranks; the answers resumed over
the link to rank 0) and resume (`generate --np`: one answer, or a file of prompts, that survives a lost rank).
Imports the serving seam, rank 0's feeders (a batch file's lines) and the wire; the command line imports it.
"""
