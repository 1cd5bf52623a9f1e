"""torchrun worker: Qwen3.5 / Qwen3-Next hybrids (Gated DeltaNet + gated attention) in megatron-core vs HF transformers.

For every layout (``tp<T>-pp<P>-ep<E>[-sp]``; DP = world / (TP x PP)) each rank, for each tiny family model
(``tiny_hybrid_model``):
  1. builds the seeded HF model in fp32 (every norm, A_log and dt_bias perturbed so that a wrong offset or TP slice
     shows): its logits on this DP rank's micro-batches, and a float64 copy's gradients of mean_DP(mean_mb(NLL));
  2. builds the Megatron chunks with ``build_gpt_chunks`` and fills them by the HF-direct start
     (``weights/loading.load_mcore_checkpoint`` on the HF directory the test saved with ``save_tiny_hybrid``: the
     Qwen3.5 model is the VLM, its names carry ``model.language_model.`` and its vision tower is left out);
  3. wraps them for training and runs ``forward_backward_func`` over two micro-batches (a full one, and one whose
     rows end in padding: the training layout is left-aligned, prompt, response, then padding) with a mean token
     NLL, then ``finalize_model_grads``;
  4. records max|logits - HF| over the valid positions (last stage), every local gradient's relative error against
     the float64 one (max-abs and Frobenius), and which global layers this rank built as Gated DeltaNet;
  5. with ``--ckpt-root``: the ``--save-at`` layout saves its chunks with megatron-core's ``dist_checkpointing``, and
     each later layout loads that checkpoint into fresh chunks (resharded) and compares every parameter; with
     ``--converted-root``: every layout loads the converter's Megatron checkpoint and compares the same way.
Writes ``<out>/rank<r>.json``; ``test_models_qwen35.py`` asserts.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path
from typing import Any, Optional

import torch

from tests.helpers.schedule import run_schedule
from tests.helpers.worker import write_rank_report

VOCAB = 100
SEQ = 12
BATCH = 2
HF_SEED = 0
# Valid lengths of the padded micro-batch's rows (the rest is padding at the end).
VALID_LEN = (7, 10)
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")

# Shared sizes: 4 attention heads in 2 query groups, head_dim 16 (a quarter rotated), 2 key / 4 value GDN heads.
_COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,  # larger weights than the default 0.02: every block moves the logits
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
}


def tiny_hybrid_config(family: str):
    """qwen3_5: the dense VLM (Qwen3_5ForConditionalGeneration), 6 layers at full_attention_interval 4 (layers
    0-2, 4, 5 linear, 3 full: not a multiple of the interval). qwen3_next: MoE (4 experts, top-2, a gated shared
    expert; layer 0 dense), 6 layers at interval 2 (layers 1, 3, 5 full), in_proj grouped per key head.
    qwen3_5_moe: the MoE VLM (every layer MoE: 4 experts, top-2, gated shared expert), 6 layers at interval 3."""
    # heavy: transformers
    from transformers import Qwen3_5Config, Qwen3_5MoeConfig, Qwen3NextConfig

    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64}
    if family == "qwen3_5":
        text = dict(_COMMON, num_hidden_layers=6, full_attention_interval=4, tie_word_embeddings=False)
        return Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False)
    if family == "qwen3_5_moe":
        text = dict(_COMMON, num_hidden_layers=6, full_attention_interval=3, tie_word_embeddings=False)
        del text["intermediate_size"]
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        return Qwen3_5MoeConfig(text_config=dict(text, router_aux_loss_coef=0.0), vision_config=vision)
    if family == "qwen3_next":
        return Qwen3NextConfig(
            **_COMMON,
            num_hidden_layers=6,
            full_attention_interval=2,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[0],
            router_aux_loss_coef=0.0,
        )
    raise ValueError(family)


def tiny_hybrid_model(family: str, seed: int = HF_SEED):
    """The HF model of ``tiny_hybrid_config(family)``, seeded, fp32, eager; norms (zero-centred: around 0; the GDN
    output norm: around 1), A_log and dt_bias perturbed."""
    # heavy: transformers
    from transformers import Qwen3_5ForConditionalGeneration, Qwen3_5MoeForConditionalGeneration, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    config = tiny_hybrid_config(family)
    classes = {
        "qwen3_5": Qwen3_5ForConditionalGeneration,
        "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
        "qwen3_next": Qwen3NextForCausalLM,
    }
    cls = classes[family]
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    model.config._experts_implementation = "eager"
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("A_log", "dt_bias")):
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def save_tiny_hybrid(family: str, directory) -> None:
    """``tiny_hybrid_model(family)`` as an HF checkpoint (config.json + safetensors) in ``directory``."""
    tiny_hybrid_model(family).save_pretrained(directory)


def make_micro_batches(dp_rank: int) -> list[dict[str, torch.Tensor]]:
    """Micro-batch 0: full rows; micro-batch 1: rows of ``VALID_LEN`` tokens then padding (id 0). Per DP rank."""
    g = torch.Generator().manual_seed(1234 + dp_rank)
    out = []
    for index in range(2):
        ids = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
        targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        valid = torch.ones(BATCH, SEQ, dtype=torch.bool)
        if index == 1:
            for row, n in enumerate(VALID_LEN):
                valid[row, n:] = False
            ids = torch.where(valid, ids, torch.zeros_like(ids))
        causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)
        pos = torch.arange(SEQ).expand(BATCH, SEQ)
        out.append(
            {"index": index, "ids": ids, "targets": targets, "valid": valid, "pos": pos, "mask": causal[None, None]}
        )
    return out


def parse_layout(name: str) -> dict[str, Any]:
    """``tp2-pp1-ep2-etp1-sp`` -> sizes (ETP: expert tensor parallel size, default TP)."""
    match = re.fullmatch(r"tp(\d+)-pp(\d+)-ep(\d+)(?:-etp(\d+))?(-sp)?", name)
    if match is None:
        raise ValueError(f"layout {name!r}: expected tp<N>-pp<N>-ep<N>[-etp<N>][-sp]")
    tp, pp, ep, etp, sp = match.groups()
    return {"tp": int(tp), "pp": int(pp), "ep": int(ep), "etp": int(etp) if etp else None, "sp": sp is not None}


def token_loss(logits: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of ``targets`` over the valid positions."""
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return -(logp * valid).sum() / valid.sum()


def hf_references(family: str, dp_rank: int, dp_size: int) -> tuple[dict, dict]:
    """HF fp32 logits of this DP rank's micro-batches, and the float64 gradients (text model, experts unfused) of
    mean_DP(mean_mb(token NLL)): what megatron-core's schedule and DDP make of the per-micro-batch losses."""
    from megatron_dapo.weights.layout import unfuse_hf_experts

    hf = tiny_hybrid_model(family)  # the same seeded model the test saved to the HF directory
    with torch.no_grad():
        logits = {mb["index"]: hf(input_ids=mb["ids"]).logits for mb in make_micro_batches(dp_rank)}
    hf64 = hf.double()
    total = 0.0
    for d in range(dp_size):
        mbs = make_micro_batches(d)
        for mb in mbs:
            out = hf64(input_ids=mb["ids"]).logits
            total = total + token_loss(out, mb["targets"], mb["valid"]) / (len(mbs) * dp_size)
    total.backward()
    grads = unfuse_hf_experts({n: p.grad.detach() for n, p in hf64.named_parameters() if p.grad is not None})
    return logits, grads


def megatron_step(cfg, arch, hf_dir: str, mbs: list) -> tuple[list, dict, str]:
    """Build the chunks, fill them by the HF-direct start, run one forward/backward over ``mbs`` and reduce the
    gradients: (DDP-wrapped chunks, the logits of each micro-batch on the last stage, what was loaded)."""
    from megatron.core.distributed import finalize_model_grads

    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.weights.loading import load_mcore_checkpoint

    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    loaded = load_mcore_checkpoint(chunks, arch, hf_dir)
    model = wrap_for_training(chunks, cfg.parallel)
    for chunk in model:
        chunk.zero_grad_buffer()
    captured, _ = run_schedule(model, mbs, VOCAB, SEQ, BATCH, token_loss, mask_key="mask")
    finalize_model_grads(model)
    return model, captured, loaded["kind"]


def grad_report(model: list, arch, grads: dict, padded: int) -> list[dict]:
    """Every local parameter's gradient against the HF float64 one, mapped and sliced as the weight is (the GDN
    output norm's offset is a constant: its gradient maps as is)."""
    from megatron_dapo.weights.layout import hf_to_mcore, tp_shard
    from megatron_dapo.weights.model_io import local_param_table, shard_group

    out = []
    for lp in local_param_table(model, arch):
        m = lp.mapping
        hf = [grads[n] for n in m.hf]
        ref_full = hf[0] if m.kind == "norm_offset" else hf_to_mcore(m, hf, arch, padded)
        size, rank = shard_group(m)
        ref = tp_shard(ref_full, m.kind, m.tp_dim, size, rank, m.sections)
        got = lp.param.main_grad.double()
        out.append(
            {
                "mcore": m.mcore,
                "rel_err": ((got - ref).abs().max() / ref_full.abs().max().clamp(min=1e-30)).item(),
                "rel_err_norm": ((got - ref).norm() / ref.norm().clamp(min=1e-30)).item(),
                "ref_absmax": ref_full.abs().max().item(),
            }
        )
    return out


def same_as_loaded(cfg, arch, model: list, source: str) -> Optional[dict[str, Any]]:
    """Build fresh chunks in this layout, fill them from the Megatron checkpoint ``source`` with the loader a run
    uses (``weights/loading.load_mcore_checkpoint``) and compare every parameter with ``model``'s (None: no
    checkpoint there)."""
    from megatron_dapo.models.builder import build_gpt_chunks, unwrap
    from megatron_dapo.weights.loading import load_mcore_checkpoint

    if not Path(source).is_dir():
        return None
    fresh = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    kind = load_mcore_checkpoint(fresh, arch, source)["kind"]
    want = dict(unwrap(model[0]).named_parameters())
    got = dict(unwrap(fresh[0]).named_parameters())
    diff = max((got[n] - want[n]).abs().max().item() for n in want)
    return {"kind": kind, "params": len(got), "same_names": sorted(got) == sorted(want), "max_abs_diff": diff}


def save_megatron(model: list, directory: str) -> None:
    """This layout's chunks through megatron-core's ``dist_checkpointing`` (per-layer keys; the GDN's in_proj and
    conv1d in pieces: its own ``sharded_state_dict``)."""
    from megatron.core import dist_checkpointing

    from megatron_dapo.models.builder import unwrap
    from megatron_dapo.weights.dist_format import model_sharded_state_dict

    Path(directory).mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model_sharded_state_dict([unwrap(c) for c in model]), directory)


def run_family(cfg, family: str, dirs: dict[str, str], save: bool = False) -> dict[str, Any]:
    """``dirs``: ``hf`` (the saved HF checkpoint), and optionally ``ckpt`` (the Megatron checkpoint this layout saves
    when ``save``, or loads when an earlier layout saved it) and ``converted`` (``convert hf-to-mcore``'s output)."""
    hf_dir = dirs["hf"]
    from megatron.core import parallel_state as ps
    from megatron.core.ssm.gated_delta_net import GatedDeltaNet

    from megatron_dapo.models.builder import unwrap
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.weights.layout import padded_vocab_size
    from megatron_dapo.weights.model_io import chunk_layer_offset

    t0 = time.time()
    dp_size, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    arch = model_arch_from_hf(hf_dir)
    hf_logits, hf_grads = hf_references(family, dp_rank, dp_size)
    mbs = make_micro_batches(dp_rank)
    model, captured, loaded = megatron_step(cfg, arch, hf_dir, mbs)
    pp_size, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    offset = chunk_layer_offset(arch, pp_size, pp_rank, None, 0)
    layers = unwrap(model[0]).decoder.layers
    gdn_layers = [offset + i for i, layer in enumerate(layers) if isinstance(layer.self_attention, GatedDeltaNet)]
    padded = padded_vocab_size(
        arch.vocab_size, cfg.model.make_vocab_size_divisible_by, ps.get_tensor_model_parallel_world_size()
    )
    result: dict[str, Any] = {"logits": {}, "gdn_layers": gdn_layers, "loaded": loaded, "dp_size": dp_size}
    result["grads"] = grad_report(model, arch, hf_grads, padded)
    if dirs.get("ckpt") and save:
        save_megatron(model, dirs["ckpt"])
    elif dirs.get("ckpt"):
        result["reload"] = same_as_loaded(cfg, arch, model, dirs["ckpt"])
    if dirs.get("converted"):
        result["converted"] = same_as_loaded(cfg, arch, model, dirs["converted"])
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        for mb in mbs:
            i = mb["index"]
            diff = (captured[i] - hf_logits[i])[mb["valid"]].abs().max().item()
            result["logits"][str(i)] = {"max_abs": diff, "ref_absmax": hf_logits[i].abs().max().item()}
    result["seconds"] = round(time.time() - t0, 2)
    return result


def family_dirs(args: argparse.Namespace, family: str) -> dict[str, str]:
    roots = {"hf": args.hf_root, "ckpt": args.ckpt_root, "converted": args.converted_root}
    return {k: f"{root}/{family}" for k, root in roots.items() if root}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--hf-root", required=True, help="<hf-root>/<family>: the saved tiny HF checkpoints")
    parser.add_argument("--ckpt-root", default="", help="<ckpt-root>/<family>: the Megatron checkpoint round trip")
    parser.add_argument("--converted-root", default="", help="<converted-root>/<family>: convert hf-to-mcore output")
    parser.add_argument(
        "--save-at", default="", help="the layout that saves the Megatron checkpoint (the later ones load it)"
    )
    args = parser.parse_args()

    from megatron.core import parallel_state as ps

    from megatron_dapo.config import load_config
    from megatron_dapo.parallel import destroy_model_parallel, init_distributed, init_model_parallel

    report: dict[str, Any] = {"layouts": {}}
    info = None
    for name in args.layouts.split(","):
        lay = parse_layout(name)
        cfg = load_config(
            None,
            [
                f"parallel.tensor_model_parallel_size={lay['tp']}",
                f"parallel.pipeline_model_parallel_size={lay['pp']}",
                f"parallel.expert_model_parallel_size={lay['ep']}",
                f"parallel.sequence_parallel={str(lay['sp']).lower()}",
                "parallel.platform=cpu",
                "model.params_dtype=fp32",
                "actor.moe_aux_loss_coeff=0",
            ]
            + ([f"parallel.expert_tensor_parallel_size={lay['etp']}"] if lay["etp"] else []),
        )
        info, _ = init_distributed(cfg.parallel)
        init_model_parallel(cfg.parallel, seed=1)
        report["layouts"][name] = {
            "rank": info.rank,
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "families": {
                family: run_family(cfg, family, family_dirs(args, family), save=name == args.save_at)
                for family in args.families.split(",")
            },
        }
        destroy_model_parallel()
    write_rank_report(args.out, info.rank, report)


if __name__ == "__main__":
    main()
