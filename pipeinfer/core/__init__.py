"""The pure core: what every other part agrees on, with no llama.cpp, no MPI and no I/O beyond files.

config (the run's configuration, in sections), protocol (every pipeline message declared once: kinds, tags,
headers, payload layouts), sampling (how a request asks its tokens drawn, and a run's sampling groups), verify (the
target's draws and the acceptance rules), decoding (constraints, biases, penalties, log-probabilities asked),
kvplan (KV sequence partitions, the KV operations of a run, the context budget), recurrent (sequences of models
with recurrent layers), prefixcache (the prompt cache's entries), stagecache (stage files kept on a host),
topology (ranks, roles and layer splits), metrics (a generation's counters and timings), results (the CSV of
runs), files (the cache, atomic writes, the prompt files) and errors (the user's mistake). Imports nothing above
it.
"""
