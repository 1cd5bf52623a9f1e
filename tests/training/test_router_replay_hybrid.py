"""MoE routing replay on a hybrid: a tiny Qwen3.5-MoE (Gated DeltaNet + gated attention, every layer MoE) through the
real ``MegatronActor`` (``router_replay_hybrid_worker.py``), against float64 HF transformers with the routing forced
by hand. The anchors' open issue is replay silently doing nothing on Qwen3.5; here the replayed routing is shown to
be the one used, in the log-probs and in the update's gradients."""

from pathlib import Path

import torch

from tests.helpers.torchrun import run_torchrun
from tests.training.router_replay_hybrid_worker import UNUSED_EXPERT

WORKER = Path(__file__).with_name("router_replay_hybrid_worker.py")


def test_router_replay_drives_a_hybrid_moes_log_probs_and_update(tmp_path):
    run_torchrun(WORKER, 1, ["--out", str(tmp_path)], port=29361, timeout=600)
    r = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert r["replayer"] and r["moe_layers"] == 6
    # The actor's own routing is HF's, and replaying it changes nothing.
    assert r["own_vs_hf_routing_equal"]
    assert r["own_max_abs"] == 0.0
    assert r["plain_vs_hf"] <= 1e-4
    # A random routing replayed gives HF's log-probs of that routing, far from the model's own.
    assert r["forced_vs_hf"] <= 1e-4
    assert r["forced_vs_plain"] > 0.05
    # Free routing sends tokens to UNUSED_EXPERT in every layer; the replayed routing never does, and its gradient is 0.
    free, replayed = r["free_grads"], r["replayed_grads"]
    assert len(free) == 6 * 4 and set(free) == set(replayed)
    for key in free:
        if key.endswith(f"/e{UNUSED_EXPERT}"):
            assert free[key] > 0 and replayed[key] == 0.0, key
        else:
            assert replayed[key] > 0, key
    assert r["update_ok"] == 1.0
