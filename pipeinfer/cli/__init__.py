"""The front ends: what a user runs.

main (the `pipeinfer` command: generate and serve), batch (generate --prompts: a file of prompts, several
at once), options (the pipeline's options as typed values),
guard (the error rule: one line and a non-zero exit on every rank), server (the OpenAI-compatible HTTP
server on rank 0), status (the live status line), launch (a job from a hostfile, with the right MPI
launcher), plot (charts of a results CSV), twin_cmds (profile, simulate, plan) and models_cmd (models
list, path, fetch). Nothing imports it.
"""
