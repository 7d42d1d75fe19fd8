"""The serving process and what keeps it alive: everything between a client and rank 0's scheduler.

app (the OpenAI-compatible HTTP server: requests, streaming, the pump that feeds the scheduler), batch
(`generate --prompts`: a file of prompts, several at once), supervisor (a process manager: runs the pipeline as
a child MPI job, re-forms it without a lost host and resumes what was in flight), attach (rank 0's end of a
supervised job: the scheduler fed over the supervisor's socket) and resume (`generate --np`: one answer that
survives a lost rank). Imports the core, the wire, the ranks; the front ends (cli) import it.
"""
