"""The decisions of rank 0, free of MPI and llama.cpp: what each round launches, verifies, commits and cancels.

port (the pipeline's interface, PipePort, and its Result), head (one generation: the paper's algorithm as a
state machine), shape (the size and shape of a micro-batch), rules (a request's masks and biases for its rows),
actions (launches, cancels and KV edits as values, and the executor that carries them out on a port), scheduler
(several generations over one pipeline: admission, cells, the drafter's lease, routing results). The ranks
(ranks/) drive a real pipeline with it, the digital twin (twin/) a simulated one; nothing here imports mpi4py.
"""
