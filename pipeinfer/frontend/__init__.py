"""The HTTP server (`pipeinfer serve`): everything between a client and a generator of answers.

app (the process's wiring: every API's routes, /health, /v1/models, /tokenize), openai_api / openai_reply
(OpenAI's chat and completions: bodies and routes, replies), anthropic_api (Anthropic's Messages), responses_api
(OpenAI's Responses), each registering its own routes; sse (server-sent events, as they all stream), turn (a
conversation with tools, whatever API it came in by), tools (tool calls checked and parsed), submit (a body read,
a request's jobs made, queued and collected; the seed named), access (keys, limits, TLS warnings), metrics
(Prometheus), page and state (the live page). It drives a generator it is given: rank 0's generation thread
(feeders/generator.py) under mpiexec, or a supervisor (supervisor/) that runs the MPI job as a child. Imports the
serving seam and what is below it; only the command line imports it, and nothing of it imports mpi4py.
"""
