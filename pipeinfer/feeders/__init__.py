"""Rank 0's feeders: what runs inside the MPI job's rank 0 and feeds its scheduler.

pump (the one loop that steps the scheduler, taking each feeder's requests), generator (the generation thread of
`serve` under mpiexec, fed by the HTTP server in the same process), attach (`pipeinfer attach SOCKET`: the scheduler
fed over a supervisor's link) and batch (`generate --prompts FILE`: a file of prompts, several at once). Imports
the serving seam and the ranks.
"""
