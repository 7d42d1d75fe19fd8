"""The seam every serving process shares: a job and its events (job), an answer's text and log-probabilities on
the way out (answer), the supervisor <-> rank 0 link's messages (link) and the prompts file of a batch and its
answer lines (batchfile). Imports only the core and the engine's
tokenizer interface; the HTTP server, the supervisor and rank 0's feeders import it.
"""
