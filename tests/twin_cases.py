"""Clusters, generation settings and a hand-written profile for the digital twin's tests."""
import json

from pipeinfer.decide.genconfig import GenConfig
from pipeinfer.twin.cluster import Cluster, Link, StageCost


def equal_stages(n: int, ms: float = 10.0, latency_s: float = 0.0, bandwidth_Bps: float = 1e18, draft_ms: float = 0.0,
                 draft_on: str = "head", by_batch=None) -> Cluster:
    link = Link(latency_s, bandwidth_Bps)
    cost = StageCost(list(by_batch) if by_batch else [ms] * 4, 0.0)
    return Cluster([cost] * n, [link] * n, 64, draft_ms, 0.0, draft_on, link, head_overhead_ms=0.0, abort_check_ms=0.0)


def gen(mode: str, n: int = 64, draft_max: int = 1, p_recovery=0.0, p_accept=0.5) -> GenConfig:
    return GenConfig(mode=mode, n_predict=n, p_accept=p_accept, draft_max=draft_max, p_recovery=p_recovery,
                     stop_at_eos=False)


# a profile written by hand: two hosts, the second `slow` times as slow per layer
def hand_profile(tmp_path, slow: float = 2.0):
    lm = {"probe_layers": 2, "fixed_ms": [1.0, 1.0, 1.0], "layer_ms": [2.0, 2.2, 2.4], "out_ms": [10.0, 11.0, 12.0],
          "prompt_fixed_ms_per_token": 0.1, "prompt_layer_ms_per_token": 0.5, "prompt_out_ms_per_token": 2.0}

    def stage(n_layers, last, factor):
        return [factor * (lm["fixed_ms"][i] + n_layers * lm["layer_ms"][i] + (lm["out_ms"][i] if last else 0))
                for i in range(3)]
    prof = {"format": 1, "kernels": "repack", "exact_batch": 3,
            "model": {"path": "m.gguf", "n_layer": 20, "n_embd": 64, "n_vocab": 1000, "file_bytes": 1},
            "ranks": [{"rank": 0, "host": "a", "threads": 1, "layers": [0, 10], "last": False,
                       "ms_by_batch": stage(10, False, 1.0), "prompt_ms_per_token": 5.0},
                      {"rank": 1, "host": "b", "threads": 1, "layers": [10, 20], "last": True,
                       "ms_by_batch": stage(10, True, slow), "prompt_ms_per_token": 10.0}],
            "links": [{"from": 0, "to": 1, "latency_s": 1e-4, "bandwidth_bps": 1e9},
                      {"from": 1, "to": 0, "latency_s": 1e-4, "bandwidth_bps": 1e9}],
            "layer_model": lm, "draft": {"model": "d.gguf", "ms_per_token": 1.0, "prefill_ms_per_token": 0.1},
            "head_overhead_ms": 0.1}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(prof))
    return path
