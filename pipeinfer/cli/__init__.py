"""The front ends: what a user runs.

main (the `pipeinfer` command: generate, serve and the error rule: one line and a non-zero exit on every
rank), server (the OpenAI-compatible HTTP server on rank 0), status (the live status line), launch (a job
from a hostfile, with the right MPI launcher) and plot (charts of a results CSV). Nothing imports it.
"""
