"""pipeinfer: PipeInfer (asynchronous pipelined speculative inference) for GGUF models on CPU clusters."""
__version__ = "0.1.0"
