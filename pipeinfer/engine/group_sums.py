"""A tensor group member's partial sums, added to the other members' in the middle of llama.cpp's graph.

Each member of a group (slices.py) computes a layer's attention output and feed-forward output from its own heads
and columns: a partial sum of the whole layer's. StageEngine hooks those nodes through cb_eval; after llama.cpp
computed one, PartialSums reads it (f32[rows, n_embd]), hands it to `exchange` (the group's all-gather, over MPI:
ranks/group.py), which returns every member's partial sum in member order, adds them in that order (so every member
holds the same bits and a group is deterministic) and writes the total back before the residual add reads it.

The nodes, as llama.cpp's llama graph names them (src/models/llama.cpp): `attn_out-{il}`, then the feed-forward's
output `ffn_out-{il}` (a MoE layer's is `ffn_moe_out-{il}`); the residual sum after it is named `ffn_out-{il}` too,
and is not a partial sum: only the first node of each name in a decode is added up.

The exchange also carries one float a member adds to its rows: the leader's wish to abort a speculative run, so every
member sees it at the same node and stops its decode at the same place (llama.cpp polls `aborting` after nodes).
"""
from __future__ import annotations

from typing import Callable

import numpy as np


class PartialSums:
    PREFIXES = (b"attn_out", b"ffn_out-", b"ffn_moe_")  # the first 8 bytes of a hooked node's name (stage.name_key)
    NAMES = (b"attn_out-", b"ffn_out-", b"ffn_moe_out-")

    def __init__(self, exchange: Callable[[np.ndarray], np.ndarray], wish_to_abort: Callable[[], bool] | None = None):
        self.exchange = exchange            # f32[n + 1] mine -> f32[members, n + 1] every member's, in member order
        self.wish_to_abort = wish_to_abort  # the leader's: polled at each exchange while a run may be cancelled
        self.aborting = False               # the leader's wish as of the last exchange
        self.n_exchanges = 0
        self._done: set[bytes] = set()

    def begin(self) -> None:
        """A decode starts (its caller says so: ranks/group.py): every layer's partial sums are still to be added."""
        self._done.clear()
        self.aborting = False

    def on_node(self, tensor, ask: bool, ggml) -> bool:
        """cb_eval for a node whose name starts like a hooked one: ask, whether llama.cpp should stop at it; else it is
        computed, and added up."""
        name = ggml.ggml_get_name(tensor)
        if not (name.startswith(self.NAMES) and name not in self._done):
            return not ask
        if not ask:
            self.add_up(tensor, name, ggml)
        return True

    def add_up(self, tensor, name: bytes, ggml) -> None:
        """The node `name` (just computed, f32) becomes the sum of every member's."""
        nbytes = ggml.ggml_nbytes(tensor)
        n = nbytes // 4
        mine = np.empty(n + 1, dtype=np.float32)
        ggml.ggml_backend_tensor_get(tensor, mine.ctypes.data, 0, nbytes)
        mine[n] = 1.0 if self.wish_to_abort is not None and self.wish_to_abort() else 0.0
        every = self.exchange(mine)
        total = add_in_order(every[:, :n])
        self.aborting = bool(every[0, n])
        ggml.ggml_backend_tensor_set(tensor, total.ctypes.data, 0, nbytes)
        self.n_exchanges += 1
        self._done.add(name)
        if name.startswith(b"ffn_moe_out-"):
            self._done.add(b"ffn_out-" + name[len(b"ffn_moe_out-"):])


def add_in_order(parts: np.ndarray) -> np.ndarray:
    """parts f32[members, n] -> f32[n]: ((p0 + p1) + p2) + ..., the same bits on every member."""
    total = parts[0].copy()
    for p in parts[1:]:
        total += p
    return total
