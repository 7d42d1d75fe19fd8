"""The stage engine: llama.cpp through llama-cpp-python, one layer range of a GGUF per stage.

stage (a model + context for a layer range: hidden states in, hidden states or logits out, abortable
mid-decode), stagefile (GGUF files holding a range of another's layers, pruned output heads), ggufheader
(a fast GGUF header reader), kernels (kernel settings and the exact batch limit), models (the registry
and fetcher of the real models), tokenizer (text <-> token ids), chat (the chat format), grammar (constraints as
token masks), drafts (which small model drafts for a target). Imports only the core.
"""
