"""The ranks' processes: what each MPI rank runs once the job starts, over the decisions of decide/.

pipeline (the head's end of the pipeline: its own stage, sends, results, cancellation; decide/port.PipePort over
MPI), session (rank 0's generation loop on a real pipeline), worker (the loop of every other rank), draft_rank
(a rank that only drafts), weights (layers sent to ranks that lack them), handshake (every rank agrees on build,
model and layer plan) and startup (one generation or session set up on every rank, in named steps).
"""
