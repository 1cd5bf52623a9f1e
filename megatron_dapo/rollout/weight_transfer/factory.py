"""The one place a run's weight sync is built: from ``RunPlan.weight_transport`` (``config/plan.weight_transport``
chose it, with its reason, from the config, the platform and the model) and the config sections the sync reads."""

from __future__ import annotations

from megatron_dapo.config import RolloutConfig
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.models.families import ModelArch
from megatron_dapo.rollout.sync import WeightSync
from megatron_dapo.rollout.weight_transfer.lora_transport import LoraAdapterSync
from megatron_dapo.rollout.weight_transfer.transport import ActorWeightSync, WeightTarget


def sync_bucket_bytes(rollout: RolloutConfig) -> int:
    """``rollout.weight_sync_bucket_mb`` in bytes (the config's rules keep it positive)."""
    return rollout.weight_sync_bucket_mb * 2**20


def build_weight_sync(
    target: WeightTarget, arch: ModelArch, plan: RunPlan, rollout: RolloutConfig, lora: LoRAConfig
) -> ActorWeightSync:
    """The sync for ``target`` (the colocated engine, or the async bridge's ``rollout/remote.BridgeSender``):

    * ``lora_adapters``: ``LoraAdapterSync`` in ``vllm_lora`` mode (the base once, then the adapters alone);
    * ``direct`` or ``reload`` with a LoRA actor (the async bridge, which has no adapter path): ``LoraAdapterSync``
      in ``merge`` mode, the adapters merged into every full push;
    * ``direct`` or ``reload``: ``WeightSync`` with that transport.
    """
    bucket = sync_bucket_bytes(rollout)
    if plan.weight_transport == "lora_adapters":
        return LoraAdapterSync(target, arch, lora, bucket, "vllm_lora")
    if lora.rank > 0:
        return LoraAdapterSync(target, arch, lora, bucket, "merge")
    return WeightSync(target, arch, bucket, plan.weight_transport)
