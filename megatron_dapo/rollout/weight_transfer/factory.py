"""The one place a run's weight sync is built: from ``RunPlan.weight_transport`` (``config/plan.weight_transport``
chose it, with its reason, from the config, the platform and the model) and the config sections the sync reads; in
an asynchronous job the push over the bridge (``build_bridge_push``)."""

from __future__ import annotations

from megatron_dapo.config import RolloutConfig
from megatron_dapo.config.plan import RunPlan
from megatron_dapo.config.schema import LoRAConfig
from megatron_dapo.models.families import ModelArch
from megatron_dapo.rollout.remote import BridgeSender
from megatron_dapo.rollout.sync import WeightSync
from megatron_dapo.rollout.weight_transfer.lora_transport import LoraAdapterSync, merged_sync
from megatron_dapo.rollout.weight_transfer.owner_push import OwnerPush
from megatron_dapo.rollout.weight_transfer.transport import ActorWeightSync, WeightTarget


def sync_bucket_bytes(rollout: RolloutConfig) -> int:
    """``rollout.weight_sync_bucket_mb`` in bytes (the config's rules keep it positive)."""
    return rollout.weight_sync_bucket_mb * 2**20


def build_weight_sync(
    target: WeightTarget, arch: ModelArch, plan: RunPlan, rollout: RolloutConfig, lora: LoRAConfig
) -> ActorWeightSync:
    """The sync for ``target`` (the colocated engine; an async job's push is ``build_bridge_push``'s):

    * ``lora_adapters``: ``LoraAdapterSync`` in ``vllm_lora`` mode (the base once, then the adapters alone);
    * ``direct`` or ``reload`` with a LoRA actor (an engine without LoRA): ``LoraAdapterSync`` in ``merge`` mode, the
      adapters merged into every full push;
    * ``direct`` or ``reload``: ``WeightSync`` with that transport.
    """
    bucket = sync_bucket_bytes(rollout)
    if plan.weight_transport == "lora_adapters":
        return LoraAdapterSync(target, arch, lora, bucket, "vllm_lora")
    if lora.rank > 0:
        return LoraAdapterSync(target, arch, lora, bucket, "merge")
    return WeightSync(target, arch, bucket, plan.weight_transport)


class MergedPush:
    """A LoRA actor's push over the async bridge, which has no adapter path: the adapters merged into every push
    (``lora_transport.merged_sync``; the push copies the merged tensors before they are unmerged)."""

    def __init__(self, push: OwnerPush) -> None:
        self.push = push

    def sync(self, actor_chunks: list) -> dict[str, float]:
        return merged_sync(self.push, actor_chunks)


def build_bridge_push(
    bridge: BridgeSender, arch: ModelArch, rollout: RolloutConfig, lora: LoRAConfig
) -> ActorWeightSync:
    """The push of an asynchronous job (trainer.mode=async): ``owner_push.OwnerPush`` over ``bridge``, each tensor
    from the training rank that owns it; a LoRA actor's merged (``MergedPush``)."""
    push = OwnerPush(bridge, arch, sync_bucket_bytes(rollout))
    return MergedPush(push) if lora.rank > 0 else push
