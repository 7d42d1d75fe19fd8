"""The wire: how ranks reach each other, over MPI and beside it.

transport (buffer-interface sends of numpy arrays with polite waiting, so a waiting rank never steals its
neighbour's core), liveness (each rank's heartbeat, and the liveness words declared once), hub (the watcher
process beside rank 0 that names a lost or silent rank and ends the job), hosts (how a rank and its host are
named in every message), netprobe (MPI ping-pong: the latency and bandwidth a link really gives), launcher
(mpiexec, srun and hostfiles), container (ranks in pipeinfer's image: the ssh stand-in and a Slurm task's
container), slurm (a Slurm allocation as hosts) and doctor (the hosts checked before a job).
Imports only the core.
"""
