"""torchrun worker: the megatron-core reward model (``megatron_dapo/rm/``) against HF ``*ForSequenceClassification``.

For each layout (``tp1``: DP = world, ``tp2``: TP = 2) and each family (qwen2 with tied embeddings, qwen3 with
qk-norm, llama with llama3 rope scaling) every rank:
  1. builds the same seeded tiny HF classifier (num_labels 1, pad_token_id ``PAD_ID``, random norms and a unit-scale
     score head), rank 0 saves it (safetensors) and converts it with ``convert_hf_to_mcore``;
  2. computes HF's scores of ``SEQUENCES`` (different lengths; one ends with the pad id, which HF skips) three ways:
     each sequence alone, in a right-padded batch and in a left-padded batch (attention mask, and position ids that
     count real tokens only);
  3. builds the reward model (``build_reward_model``), loads it from the HF directory and from the converted
     checkpoint (``load_reward_model``) and scores the sequences with ``RewardModelScorer.score`` (collective: rows
     dealt over the DP ranks, micro-batches of 2, gathered).
Each rank writes ``<out>/rank<r>.json``; the test asserts.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests.helpers.worker import write_rank_report

FAMILIES = ("qwen2", "qwen3", "llama")
PAD_ID = 0
RM_WEIGHT = 0.5
BASE_REWARD = 0.25
TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml"
SEED = 3
# Token ids 1..99 except the deliberate trailing pad id of row 2 (HF scores the token before it).
SEQUENCES = [
    [5, 17, 33, 2, 91, 40, 7, 7, 12, 64, 3],
    [8, 1, 99],
    [45, 46, 47, 48, 49, 50, 12, PAD_ID],
    [23, 9, 77, 61, 18, 30, 44, 2, 5, 6, 70, 71, 72, 13, 88, 95, 51],
    [60],
]


def make_hf_classifier(family: str):
    from transformers import AutoModelForSequenceClassification

    from megatron_dapo.testing.tiny_models import tiny_hf_config

    torch.manual_seed(SEED)
    config = tiny_hf_config(family, tie_word_embeddings=family == "qwen2", num_labels=1, pad_token_id=PAD_ID)
    config._attn_implementation = "eager"
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name == "score.weight":
                p.normal_(0.0, 1.0)
    return model.eval()


@torch.no_grad()
def hf_scores(model) -> dict[str, list[float]]:
    """HF's scores: each sequence alone, right-padded together, left-padded together."""
    alone = [model(input_ids=torch.tensor([s])).logits[0, 0].item() for s in SEQUENCES]
    width = max(len(s) for s in SEQUENCES)
    out = {"alone": alone}
    for side in ("right", "left"):
        ids = torch.full((len(SEQUENCES), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(SEQUENCES):
            cols = slice(0, len(s)) if side == "right" else slice(width - len(s), width)
            ids[i, cols] = torch.tensor(s)
            mask[i, cols] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out[side] = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0].tolist()
    return out


def run_family(family: str, cfg, tmp: Path) -> dict[str, Any]:
    from megatron_dapo.config.schema import RewardModelConfig
    from megatron_dapo.rm.reward_model import build_reward_model, load_reward_model, reward_model_arch
    from megatron_dapo.rm.scorer import RewardModelScorer
    from megatron_dapo.weights.convert import convert_hf_to_mcore

    hf = make_hf_classifier(family)
    hf_dir, mcore_dir = tmp / f"{family}-hf", tmp / f"{family}-mcore"
    if dist.get_rank() == 0 and not hf_dir.exists():
        hf.save_pretrained(hf_dir, safe_serialization=True)
        convert_hf_to_mcore(hf_dir, mcore_dir)
    dist.barrier()
    hf_params = sum(p.numel() for p in hf.parameters())
    result: dict[str, Any] = {"hf": hf_scores(hf), "ours": {}, "hf_params": hf_params}
    explicit_mask = cfg.model.attention_backend == "local"
    for name, load_dir in (("hf_dir", hf_dir), ("converted", mcore_dir)):
        arch, head = reward_model_arch(load_dir)
        model = build_reward_model(arch, cfg.model, cfg.parallel)
        load_reward_model(model, arch, load_dir)
        rm_cfg = RewardModelConfig(load_dir=str(load_dir), micro_batch_size=2)
        scorer = RewardModelScorer(model, head, rm_cfg, arch.vocab_size, explicit_mask)
        result["ours"][name] = scorer.score(SEQUENCES).tolist()
        result["head_shape"] = list(model.output_layer.weight.shape)
        result["params"] = sum(p.numel() for p in model.parameters())
        result["trainable"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    result["component"] = run_component(cfg, mcore_dir)
    return result


def run_component(cfg, load_dir: Path) -> dict[str, Any]:
    """The run's way: ``RewardModelScorer.build`` from the ``reward.reward_model`` section and a resolved
    ``RunPlan``, then the reward stage's hook ``score_rollout`` on a ``RolloutBatch`` of ``SEQUENCES`` (each split
    into a prompt and a response; the last has an empty response) whose rule-based rewards are all ``BASE_REWARD``."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.plan import resolve, resolve_handoff_plan
    from megatron_dapo.handoff.offload import MemoryHandoff, reference_tensors
    from megatron_dapo.platform import get_platform
    from megatron_dapo.reward.scoring import RewardResult
    from megatron_dapo.rm.reward_model import reward_model_arch
    from megatron_dapo.rm.scorer import RewardModelScorer, score_rollout
    from megatron_dapo.rollout.types import build_rollout_batch
    from tests.training.offload_worker import CountingPlatform

    overrides = [
        f"parallel.tensor_model_parallel_size={cfg.parallel.tensor_model_parallel_size}",
        f"model.attention_backend={cfg.model.attention_backend}",
        "parallel.platform=cpu",
        "model.params_dtype=fp32",
        "model.hf_config_dir=/not/read",
        "reward.custom_function.path=null",
        f"reward.reward_model.load_dir={load_dir}",
        f"reward.reward_model.weight={RM_WEIGHT}",
        "reward.reward_model.micro_batch_size=3",
    ]
    run_cfg = load_config(TINY, overrides)
    arch, _ = reward_model_arch(load_dir)
    plan = resolve(run_cfg, arch, dist.get_world_size(), get_platform(), probe_imports=False)
    # Through a memory hand-off that offloads frozen models (the CPU platform counting its moves, as a device's
    # would): the weights leave at once, come back for the scoring and leave again.
    platform = CountingPlatform()
    handoff_plan = resolve_handoff_plan(run_cfg.actor, run_cfg.ref, run_cfg.rollout, run_cfg.trainer, platform)
    handoff = MemoryHandoff(platform, handoff_plan, [], None)
    scorer = RewardModelScorer.build(run_cfg.reward.reward_model, plan, run_cfg.model, run_cfg.parallel, handoff)
    held = lambda: sum(t.untyped_storage().nbytes() for t in reference_tensors([scorer.model]))  # noqa: E731
    held_after_build = held()
    split = [max(1, len(s) // 2) for s in SEQUENCES]
    rollout = build_rollout_batch(
        prompts=[s[:k] for s, k in zip(SEQUENCES, split)],
        responses=[s[k:] for s, k in zip(SEQUENCES, split)],
        log_probs=[[0.0] * (len(s) - k) for s, k in zip(SEQUENCES, split)],
        truncated=[False] * len(SEQUENCES),
        prompt_index=list(range(len(SEQUENCES))),
        pad_token_id=PAD_ID,
    )
    batch, width = len(SEQUENCES), rollout.responses.shape[1]
    lengths = rollout.response_mask.sum(-1)
    token_level = torch.zeros(batch, width)
    token_level[torch.arange(batch), torch.where(lengths > 0, lengths - 1, width - 1)] = BASE_REWARD
    result = RewardResult(token_level, torch.full((batch,), BASE_REWARD), {}, {}, lengths)
    score_rollout(scorer, result, rollout)
    return {
        "handoff_reference_planned": handoff_plan.reference,
        "held_after_build": held_after_build,
        "held_after_scoring": held(),
        "restored_bytes": platform.restored_bytes,
        "released_bytes": platform.released_bytes,
        "rm_bytes": sum(t.numel() * t.element_size() for t in reference_tensors([scorer.model])),
        "scores": result.scores.tolist(),
        "token_level_row_sums": result.token_level_scores.sum(-1).tolist(),
        "rm_score": result.extra["rm_score"],
        "metrics": result.metrics,
        "explicit_causal_mask": plan.explicit_causal_mask,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", default="tp1,tp2-local")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    report: dict[str, Any] = {"layouts": {}}
    info = None
    for layout in args.layouts.split(","):
        tp = int(layout.split("-")[0][2:])
        backend = "local" if layout.endswith("-local") else "sdpa"
        overrides = [
            f"parallel.tensor_model_parallel_size={tp}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            f"model.attention_backend={backend}",
        ]
        cfg = load_config(None, overrides)
        info, _ = init_distributed(cfg.parallel)
        init_model_parallel(cfg.parallel, seed=1)
        entry: dict[str, Any] = {
            "tp": ps.get_tensor_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(),
            "families": {},
        }
        for family in FAMILIES:
            entry["families"][family] = run_family(family, cfg, Path(args.out) / "ckpt")
        report["layouts"][layout] = entry
        destroy_model_parallel()
    write_rank_report(args.out, info.rank, report)


if __name__ == "__main__":
    main()
