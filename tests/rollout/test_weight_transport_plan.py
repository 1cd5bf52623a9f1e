"""The weight transport, chosen once into the ``RunPlan`` (``config/plan.weight_transport``) with its reason, printed
by ``check`` (``check/render.plan_lines``), and the sync ``rollout/weight_transfer/factory.build_weight_sync`` builds
from it. No process group: the plans are resolved for a world they do not run in, the syncs are built, not run."""

from __future__ import annotations

import pytest

from megatron_dapo.check.render import plan_lines
from megatron_dapo.config import load_config
from megatron_dapo.config.plan import weight_transport
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.platform import make_platform
from megatron_dapo.rollout.remote import BridgeSender
from megatron_dapo.rollout.sync import WeightSync
from megatron_dapo.rollout.weight_transfer.factory import build_weight_sync, sync_bucket_bytes
from megatron_dapo.rollout.weight_transfer.lora_transport import LoraAdapterSync
from tests.config.test_run_plan import _in_repo, tiny_plan  # noqa: F401 - _in_repo: the autouse fixture
from tests.config.test_run_validation import TINY, TINY_HF

ASYNC = ["trainer.mode=async", "placement.rollout_ranks=1"]


def test_plan_picks_each_transport_with_its_reason():
    # tiny_cpu.yaml on CPU (Platform.direct_weight_sync), 2 KV heads over rollout TP 1: direct.
    plan = tiny_plan()
    assert plan.weight_transport == "direct"
    direct = "colocated engine: each rank writes its rollout shard into the engine's layers"
    assert plan.weight_transport_reason == direct
    cuda = tiny_plan(platform="cuda")  # the direct path has not run there
    assert cuda.weight_transport == "reload"
    assert cuda.weight_transport_reason == (
        "the cuda platform has not run the direct path (Platform.direct_weight_sync)"
    )
    # 2 KV heads over rollout TP 4: vLLM replicates them, no rank's shard is a slice of Megatron's.
    wide = tiny_plan(["rollout.tensor_model_parallel_size=4"], world=4)
    assert (wide.weight_transport, wide.rollout.tp_size) == ("reload", 4)
    assert wide.weight_transport_reason == "2 query groups do not split over rollout TP 4 (vLLM replicates KV heads)"
    lora = tiny_plan(["actor.lora.rank=4"])
    assert lora.weight_transport == "lora_adapters"
    assert lora.weight_transport_reason.startswith("actor.lora.rank=4: the base once by reload")
    bridge = tiny_plan(ASYNC, world=3)
    assert bridge.weight_transport == "reload"
    over_bridge = "trainer.mode=async: HF tensors over the bridge to the rollout ranks' engines"
    assert bridge.weight_transport_reason == over_bridge
    merged = tiny_plan([*ASYNC, "actor.lora.rank=4"], world=3)
    assert merged.weight_transport == "reload"
    merging = "; actor.lora.rank=4: adapters merged into each push (no adapter path)"
    assert merged.weight_transport_reason == over_bridge + merging


def transport_of(cfg, arch, platform):
    """``weight_transport`` from the sections it reads."""
    return weight_transport(cfg.actor, cfg.rollout, cfg.trainer, arch, platform)


def test_the_async_bridge_wins_over_platform_and_lora():
    """The order of the rules: the async bridge first (its target takes HF tensors only), then LoRA, then the
    platform, then the model's KV heads."""
    arch = model_arch_from_hf(TINY_HF)
    cpu, npu = make_platform("cpu"), make_platform("npu")
    cfg = load_config(TINY, [*ASYNC, "actor.lora.rank=2"])
    assert transport_of(cfg, arch, cpu)[0] == transport_of(cfg, arch, npu)[0] == "reload"
    cfg = load_config(TINY, ["actor.lora.rank=2"])
    assert transport_of(cfg, arch, npu)[0] == "lora_adapters"  # on any platform: adapters need no layer lookup
    assert transport_of(load_config(TINY, []), arch, npu)[0] == "reload"


def test_check_prints_the_transport():
    cfg = load_config(TINY, [])
    sections = (cfg.parallel, cfg.actor, cfg.rollout, cfg.data, cfg.algorithm)
    lines = plan_lines(tiny_plan(), *sections, 1, 2)
    direct = "colocated engine: each rank writes its rollout shard into the engine's layers"
    assert [x for x in lines if "weight sync" in x] == [f"  weight sync: direct transport ({direct})"]
    assert lines.index(f"  weight sync: direct transport ({direct})") == 3  # right below the rollout layout
    cuda = [x for x in plan_lines(tiny_plan(platform="cuda"), *sections, 1, 2) if "weight sync" in x]
    assert cuda == [
        "  weight sync: reload transport (the cuda platform has not run the direct path (Platform.direct_weight_sync))"
    ]


@pytest.mark.parametrize(
    ("overrides", "world", "platform", "kind", "detail"),
    [
        ([], 2, "cpu", WeightSync, "direct"),
        ([], 2, "cuda", WeightSync, "reload"),
        (["actor.lora.rank=4"], 2, "cpu", LoraAdapterSync, "vllm_lora"),
    ],
)
def test_factory_builds_the_planned_sync(overrides, world, platform, kind, detail):
    """The colocated engine's sync (an async job's push is ``build_bridge_push``'s: test_bridge_owner_push.py)."""
    overrides = [*overrides, "rollout.weight_sync_bucket_mb=3"]
    cfg = load_config(TINY, overrides)
    plan = tiny_plan(overrides, world=world, platform=platform)
    target = BridgeSender(None, plan.rollout, make_platform(platform))  # the real bridge end, no group: sends nothing
    sync = build_weight_sync(target, model_arch_from_hf(TINY_HF), plan, cfg.rollout, cfg.actor.lora)
    assert type(sync) is kind
    base = sync.base_sync if kind is LoraAdapterSync else sync
    assert base.bucket_bytes == sync_bucket_bytes(cfg.rollout) == 3 * 2**20
    if kind is LoraAdapterSync:
        assert (sync.mode, base.planned) == (detail, "reload")  # the base always by reload (no LoRA-wrapped lookup)
    else:
        assert base.planned == detail


def test_weight_sync_refuses_an_unknown_transport():
    plan = tiny_plan()
    target = BridgeSender(None, plan.rollout, make_platform("cpu"))
    with pytest.raises(ValueError, match="WeightSync transport 'lora_adapters'"):
        WeightSync(target, model_arch_from_hf(TINY_HF), 1, "lora_adapters")


def test_a_hybrid_with_lora_merges_its_adapters_into_each_push():
    """A Qwen3.5's fused Gated DeltaNet in_proj adapter is several vLLM LoRA modules, which no transport maps: its
    adapters are merged into the platform's full-weight transport (``build_weight_sync`` builds a LoRA actor's sync in
    merge mode for any transport but lora_adapters)."""
    from tests.models.qwen35_worker import tiny_hybrid_config

    arch = model_arch_from_hf(tiny_hybrid_config("qwen3_5").to_dict())
    cfg = load_config(TINY, ["actor.lora.rank=4"])
    merged = "; actor.lora.rank=4: adapters merged into each push (Gated DeltaNet in_proj)"
    # vLLM's Gated DeltaNet in_proj is several layers, which the direct writer does not split: reload, where the
    # platform would write directly (tests/rollout/test_gdn_sync.py measures that path).
    split = "the Gated DeltaNet in_proj is several vLLM layers, which the direct writer does not split"
    assert transport_of(cfg, arch, make_platform("cpu")) == ("reload", split + merged)
    why = "the cuda platform has not run the direct path (Platform.direct_weight_sync)"
    assert transport_of(cfg, arch, make_platform("cuda")) == ("reload", why + merged)
    plain = load_config(TINY, [])
    assert transport_of(plain, arch, make_platform("cpu")) == ("reload", split)
