"""The wire: how ranks reach each other, over MPI and beside it.

transport (buffer-interface sends of numpy arrays with polite waiting, so a waiting rank never steals its
neighbour's core), liveness (each rank's heartbeat and the watcher that names a lost or silent rank) and
netprobe (MPI ping-pong: the latency and bandwidth a link really gives). Imports only the core.
"""
