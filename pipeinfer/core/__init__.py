"""The pure core: what every other part agrees on, with no llama.cpp, no MPI and no I/O beyond files.

protocol (every pipeline message declared once: kinds, tags, headers, payload layouts), verify (sampling
and the acceptance rules), kvplan (KV sequence partitions and the KV operations of a run), topology (ranks,
roles and layer splits), metrics (a generation's counters and timings), results (the CSV of runs), files
(the cache, atomic writes, the prompt files) and errors (the user's mistake). Imports nothing above it.
"""
