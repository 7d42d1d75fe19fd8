"""The ranks' loops: what each MPI rank runs once the job starts.

head (rank 0's scheduler of one generation: iterative, synchronous speculative and PipeInfer, as the paper's
algorithm), scheduler (several generations at once over one pipeline: admission, cells, the drafter's lease),
pipeline (the head's end of the pipeline: its own stage, sends, results, cancellation), worker (the loop of
every other rank), handshake (every rank agrees on build, model and layer plan) and startup (one
generation or session set up on every rank, in named steps). Imports everything below it.
"""
