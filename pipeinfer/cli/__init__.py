"""The front ends: what a user types.

main (the `pipeinfer` command: generate and serve), options (the pipeline's options as click declares them), guard
(the error rule: one line and a non-zero exit on every rank), status (the live status line), launch (a job from a
hostfile, with the right MPI launcher: wire/launcher.py), doctor_cmd (the hosts checked before a job), plot (charts
of a results CSV), twin_cmds (profile, simulate), plan_cmd (plan) and models_cmd (models list, path, fetch). The
processes they start live in frontend/ (the HTTP server), supervisor/ and feeders/ (rank 0's). Nothing imports it.
"""
