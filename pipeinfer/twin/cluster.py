"""The cluster the twin plays: per-stage decode costs, links, the draft's cost, and how a profile becomes one.

A `Cluster` is a description only (sim.py runs it). From a profile (profile.py) `cluster_from_profile` takes
each rank's measured costs as they are, or, for another layer split on the same hosts, each stage's cost from
the profile's layer model times its host's measured speed relative to that model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..core.topology import layer_ranges


PROMPT_PROBE_ROWS = 64   # rows of the prompt-sized batch a profile times (profile.py N_PROMPT_PROBE)


@dataclass
class StageCost:
    """One stage's decode time (ms) by batch size, as a profile measures it (profile.py measure_stage):
    ms_by_batch[b - 1] for b = 1..len, and prompt_ms_per_token, a PROMPT_PROBE_ROWS-row batch's time over its
    rows. Between the table's last size and the probe the time is interpolated linearly (a prompt chunk of
    config.PROMPT_CHUNK = 63 rows costs about what the probe measured); beyond the probe, prompt_ms_per_token
    per row (the profile measures nothing larger; on a CPU a row of a large batch costs about the same).

    The probe's rows are all outputs; a prompt chunk has at most one (its last row, in the prompt's last chunk),
    and a last stage computes the output projection only for output rows (engine/stage.py). out_ms_per_row is
    that projection's cost per row at prompt sizes (the layer model's share of prompt_ms_per_token; 0 on a stage
    without the vocabulary): a row that is not an output does not pay it."""
    ms_by_batch: list[float]
    prompt_ms_per_token: float
    out_ms_per_row: float = 0.0

    def ms(self, n_tokens: int, n_outputs: int | None = None) -> float:
        """A batch of n_tokens rows, n_outputs of them outputs (None: all)."""
        b = len(self.ms_by_batch)
        if n_tokens <= b:
            ms = self.ms_by_batch[max(0, n_tokens - 1)]
        elif n_tokens >= PROMPT_PROBE_ROWS:
            ms = n_tokens * self.prompt_ms_per_token
        else:
            top = self.ms_by_batch[-1]
            ms = top + (n_tokens - b) / (PROMPT_PROBE_ROWS - b) * (PROMPT_PROBE_ROWS * self.prompt_ms_per_token - top)
        ms = max(ms, self.ms_by_batch[-1] if n_tokens > b else 0.0)  # never cheaper than a smaller batch
        if n_outputs is not None and n_tokens > b:
            ms -= (n_tokens - min(n_outputs, n_tokens)) * self.out_ms_per_row
        return max(0.0, ms)


@dataclass
class Link:
    latency_s: float = 50e-6
    bandwidth_Bps: float = 125e6   # 1 Gbit/s

    def transfer_s(self, n_bytes: int) -> float:
        return n_bytes / self.bandwidth_Bps


@dataclass
class Cluster:
    """What the twin needs to know about a cluster: per-stage decode costs, links, the draft's cost."""
    stages: list[StageCost]                  # rank 0 (the head's stage) first
    links: list[Link]                        # links[r]: rank r <-> r+1; links[-1]: last rank <-> head
    n_embd: int
    draft_ms_per_token: float = 0.0
    draft_prefill_ms_per_token: float = 0.0
    draft_on: str = "head"                   # head | own (a host of its own, drafting ahead)
    draft_link: Link = field(default_factory=Link)
    head_overhead_ms: float = 0.3
    abort_check_ms: float = 1.0
    # ranks that share a machine: a decode that starts while k other ranks of the machine compute takes
    # shared_slowdown (memory bandwidth) x max(1, (k + 1) / its cores) times as long (profile.py measures it)
    machine_of: list[str] | None = None
    shared_slowdown: float = 1.0
    cores_of: list[int] | None = None

    @property
    def n_ranks(self) -> int:
        return len(self.stages)


# ==================================================================== clusters from a profile (profile.py)
def layer_model_ms(lm: dict, n_layers: int, last: bool, n_tokens: int) -> float:
    """A stage of n_layers (plus the output projection if last) at batch n_tokens, from a profile's
    layer model: fixed + n_layers x per-layer + output (each by batch size; prompt batches per token)."""
    b = len(lm["layer_ms"])
    if n_tokens <= b:
        i = n_tokens - 1
        return lm["fixed_ms"][i] + n_layers * lm["layer_ms"][i] + (lm["out_ms"][i] if last else 0.0)
    per_token = (lm["prompt_fixed_ms_per_token"] + n_layers * lm["prompt_layer_ms_per_token"]
                 + (lm["prompt_out_ms_per_token"] if last else 0.0))
    return layer_model_ms(lm, n_layers, last, b) + (n_tokens - b) * per_token


def active_share(tensor_name: str, n_expert: int, n_expert_used: int) -> float:
    """Share of a tensor's bytes one token reads: a routed-expert tensor (`ffn_{gate,up,down}_exps`, one slice
    per expert, gate_up fused or not) n_expert_used of its n_expert slices; everything else (attention, the
    router, shared experts, dense FFNs) all of it."""
    if n_expert > 0 and "_exps." in tensor_name:
        return n_expert_used / n_expert
    return 1.0


def active_bytes_per_layer(tensor_bytes: dict[str, int], n_layer: int, n_expert: int = 0,
                           n_expert_used: int = 0) -> float:
    """Mean weight bytes one token reads per layer of blk.0..blk.{n_layer-1}: a mixture-of-experts layer costs
    its active experts' bytes, not all of them (a memory-bound decode reads the experts the router picked).
    Blocks past n_layer (multi-token prediction) are not decoded and not counted."""
    total = 0.0
    for name, nbytes in tensor_bytes.items():
        if name.startswith("blk.") and int(name.split(".")[1]) < n_layer:
            total += nbytes * active_share(name, n_expert, n_expert_used)
    return total / n_layer


def moe_params_per_layer(n_embd: int, n_head: int, n_head_kv: int, head_dim: int, n_expert: int,
                         n_expert_used: int, n_ff_exp: int) -> tuple[int, int]:
    """(all, active) parameters of one attention + routed-experts layer (Qwen3-MoE / Mixtral shape): q, k, v, o
    projections, the router, and n_expert gated FFNs of n_ff_exp (3 matrices each), n_expert_used per token."""
    attn = n_embd * head_dim * (2 * n_head + 2 * n_head_kv)
    expert = 3 * n_embd * n_ff_exp
    router = n_embd * n_expert
    return attn + router + n_expert * expert, attn + router + n_expert_used * expert


def scaled_layer_model(lm: dict, layer_scale: float, out_scale: float) -> dict:
    """The layer model of a larger (or smaller) model on the same hosts: per-layer costs times
    layer_scale, the output projection times out_scale (memory-bound decodes: cost ~ weight bytes)."""
    out = dict(lm)
    out["layer_ms"] = [x * layer_scale for x in lm["layer_ms"]]
    out["out_ms"] = [x * out_scale for x in lm["out_ms"]]
    out["prompt_layer_ms_per_token"] = lm["prompt_layer_ms_per_token"] * layer_scale
    out["prompt_out_ms_per_token"] = lm["prompt_out_ms_per_token"] * out_scale
    return out


def speed_factor(lm: dict, rank: dict) -> float:
    """A profiled rank's measured 1-token decode over what the layer model gives for its layers: how much
    slower (or faster) its host is than the one the layer model was measured on."""
    modelled = layer_model_ms(lm, rank["layers"][1] - rank["layers"][0], rank["last"], 1)
    return rank["ms_by_batch"][0] / modelled if modelled > 0 else 1.0


def out_share(lm: dict, n_layers: int) -> float:
    """The output projection's share of a last stage's prompt cost per row, by the layer model."""
    out = lm["prompt_out_ms_per_token"]
    total = lm["prompt_fixed_ms_per_token"] + n_layers * lm["prompt_layer_ms_per_token"] + out
    return out / total if total > 0 else 0.0


def stage_cost_from_model(lm: dict, n_layers: int, last: bool, factor: float = 1.0) -> StageCost:
    b = len(lm["layer_ms"])
    ms = [factor * layer_model_ms(lm, n_layers, last, n) for n in range(1, b + 1)]
    per_token = factor * (layer_model_ms(lm, n_layers, last, b + 1) - layer_model_ms(lm, n_layers, last, b))
    return StageCost(ms, per_token, per_token * out_share(lm, n_layers) if last else 0.0)


def profile_links(profile: dict, n_ranks: int, poll_s: float = 0.0005) -> list[Link]:
    """Links as measured (a rank's polite wait adds about half a poll interval to every message)."""
    measured = {lk["from"]: lk for lk in profile.get("links", [])}
    out = []
    for r in range(n_ranks):
        lk = measured.get(r)
        if lk is None:
            raise ValueError(f"the profile has no link from rank {r}: give --bandwidth-mbit and --latency-us")
        out.append(Link(lk["latency_s"] + poll_s / 2, lk["bandwidth_bps"] / 8))
    return out


def draft_ms_per_proposal(profile: dict) -> float:
    """The profiled draft's cost per proposed token: translated (another vocabulary than the target's) where
    the profile measured it so, else its plain decode per token."""
    draft = profile.get("draft") or {}
    tr = draft.get("translating")
    return tr["ms_per_proposal"] if tr else draft.get("ms_per_token", 0.0)


def cluster_from_profile(profile: dict, *, fractions: list[float] | None = None, draft_on: str = "head",
                         link: Link | None = None, poll_s: float = 0.0005) -> Cluster:
    """The profiled cluster; with `fractions`, another layer split on the same hosts (each host's cost
    from the layer model, times its measured speed relative to that model)."""
    ranks, lm = profile["ranks"], profile["layer_model"]
    n = len(ranks)
    if fractions is None:
        stages = [StageCost(list(r["ms_by_batch"]), r["prompt_ms_per_token"],
                            r["prompt_ms_per_token"] * out_share(lm, r["layers"][1] - r["layers"][0]) if r["last"] else 0.0)
                  for r in ranks]
    else:
        ranges = layer_ranges(profile["model"]["n_layer"], fractions)
        stages = [stage_cost_from_model(lm, rr.n_layers, rr is ranges[-1], speed_factor(lm, r))
                  for r, rr in zip(ranks, ranges)]
    links = [link] * n if link is not None else profile_links(profile, n, poll_s)
    draft = profile.get("draft") or {}
    return Cluster(stages, links, profile["model"]["n_embd"], draft_ms_per_proposal(profile),
                   draft.get("prefill_ms_per_token", 0.0), draft_on, links[0],
                   profile.get("head_overhead_ms", 0.3) + poll_s / 2,
                   machine_of=[r.get("machine", r["host"]) for r in ranks],
                   shared_slowdown=profile.get("shared_slowdown", 1.0), cores_of=[r.get("cores", 1) for r in ranks])
