"""The digital twin: the real scheduler (decide/) against a simulated cluster, in virtual time.

cluster (a cluster described by measured stage costs, links and the draft, and built from a profile), machines
(machines described by their cores and memory, for plan),
sim (the simulated pipeline and simulate()), plan (the search for the fastest configuration of a profiled
cluster) and profile (measuring a real cluster for the twin). sim and plan never import llama.cpp or MPI
(a test keeps it so): a 32-host cluster is planned on a laptop. profile runs the real stages to measure them.
"""
