"""Speculation: what proposes the tokens the target verifies.

drafter (the Drafter interface and the model, n-gram and replay drafters, confidence cutoffs),
draftahead (the draft beside the pipeline: in a thread of rank 0 or on a rank of its own, drafting
ahead asynchronously), translating (a draft model of another vocabulary, translated through text) and
factory (the one place that decides same vocabulary or translate, and builds the drafter a run asks for).
Imports the core, the engine and the wire.
"""
