"""torchrun worker: MoE routing replay (``actor.router_replay=rollout``) on a tiny Qwen3-MoE actor (layer 0 dense,
layers 1-3 MoE, 8 experts, top-2) against float64 HF transformers references where the routing is forced by hand.

Layout ``ep<E>-pp<P>[-vpp<V>][-tp<T>-sp]`` (DP = world / (TP x PP)). Each rank, through the real ``MegatronActor``
(activation recomputation ``full``, so the update re-runs the routers in the backward pass):

1. ``own``: records the actor's own routing (``RouterReplayer.record``), turns it into TrainBatch fields (all-reduced
   over ranks: DP ranks hold other rows, PP ranks other layers) and replays it: log-probs must be bit-identical to
   the forward without replay (with VPP, several micro-batches: HF's own routing is replayed instead).
2. ``forced``: a random routing (distinct experts per token) replayed; reference: HF float64, each row run on its own
   tokens with every MoE gate returning that routing (weights renormalised over the forced experts).
3. ``mismatch``: the rollout policy is a perturbed float64 copy of the HF weights; its own routing and log-probs are
   the "rollout". The actor's log-probs without and with replay of that routing against the rollout's
   (``logprob_diff_metrics``), the number of routing flips, and the tokens no flip can reach (no flip at or before
   the predicting position of their row).
4. ``update``: a routing that never uses expert 7 replayed in ``compute_gradients`` (recompute on): every local
   expert's gradient norm; then ``actor.update`` on it.

``--layouts`` (comma-separated) runs several layouts of one world size in one launch, each from scratch (its own
default group and model, torn down before the next). Writes ``<out>/<layout>/rank<r>.pt``.
"""

from __future__ import annotations

import argparse
import copy
import os
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_dapo.batch import TrainBatch
from megatron_dapo.rollout.routing import moe_layer_indices, routed_experts_fields
from megatron_dapo.rollout.sync import logprob_diff_metrics
from tests.distributed.loss_batch import TEMPERATURE, make_batch

UNUSED_EXPERT = 7


class ForcedGates:
    """Patches every MoE gate of an HF Qwen3-MoE model: ``own`` mode routes by the model's float64 top-k (and records
    it), ``forced`` mode routes to ``self.forced[layer]`` (``[n, K]`` for the row being run)."""

    def __init__(self, hf, moe_layers: list[int]) -> None:
        self.mode = "own"
        self.forced: dict[int, torch.Tensor] = {}
        self.recorded: dict[int, torch.Tensor] = {}
        self.layers = moe_layers
        for layer in moe_layers:
            gate = hf.model.layers[layer].mlp.gate
            gate.forward = self._forward(gate, layer)

    def _forward(self, gate, layer: int):
        def forward(hidden_states):
            hs = hidden_states.reshape(-1, gate.hidden_dim)
            logits = F.linear(hs, gate.weight)
            probs = torch.softmax(logits, dim=-1)  # in the model's dtype (float64), unlike HF's float32
            if self.mode == "own":
                index = torch.topk(probs, gate.top_k, dim=-1).indices
                self.recorded[layer] = index
            else:
                index = self.forced[layer].to(hs.device)
            top = probs.gather(1, index)
            top = top / top.sum(-1, keepdim=True)
            return logits, top.to(logits.dtype), index

        return forward

    def row_log_probs(self, hf, b: TrainBatch, row: int, routing=None):
        """(response log-probs ``[T]`` at TEMPERATURE, own routing ``[n, L, K]``) of one row run alone."""
        p = int(b.prompt_mask[row].sum())
        r = int(b.response_mask[row].sum())
        width = b.prompts.shape[1]
        ids = torch.cat([b.prompts[row, width - p :], b.responses[row, :r]])
        layers = self.layers
        if routing is not None:
            self.mode = "forced"
            self.forced = {layer: routing[:, i].long() for i, layer in enumerate(layers)}
        else:
            self.mode = "own"
        with torch.no_grad():
            logits = hf(input_ids=ids[None]).logits[0].double()
        self.mode = "own"
        out = torch.zeros(b.responses.shape[1], dtype=torch.float64)
        logp = torch.log_softmax(logits[p - 1 : p - 1 + r] / TEMPERATURE, dim=-1)
        out[:r] = logp.gather(-1, b.responses[row, :r, None])[:, 0]
        own = torch.stack([self.recorded[layer] for layer in layers], dim=1) if routing is None else routing
        return out, own


def expert_grad_norms(chunks: list, local_experts: int) -> dict[str, float]:
    """``chunk<c>/layers.<i>/e<global expert>`` -> that expert's gradient norm on this rank, every model chunk (VPP:
    several per rank)."""
    from megatron.core import parallel_state as ps

    out: dict[str, float] = {}
    for c, chunk in enumerate(chunks):
        for name, param in chunk.named_parameters():
            m = re.search(r"layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.", name)
            if m:
                expert = ps.get_expert_model_parallel_rank() * local_experts + int(m.group(2))
                key = f"chunk{c}/layers.{m.group(1)}/e{expert}"
                out[key] = out.get(key, 0.0) + float(param.main_grad.norm())
    return out


def batch_log_probs(gates: ForcedGates, hf, b: TrainBatch, routing_rows=None):
    lps, own = [], []
    for row in range(len(b)):
        lp, routing = gates.row_log_probs(hf, b, row, None if routing_rows is None else routing_rows[row])
        lps.append(lp)
        own.append(routing)
    return torch.stack(lps), own


def row_routings_from_fields(b: TrainBatch) -> list[torch.Tensor]:
    width = b.prompts.shape[1]
    rows = []
    for row in range(len(b)):
        p, r = int(b.prompt_mask[row].sum()), int(b.response_mask[row].sum())
        rows.append(torch.cat([b.prompt_routed_experts[row, width - p :], b.response_routed_experts[row, :r]]))
    return rows


def with_routing(b: TrainBatch, rows: list[torch.Tensor]) -> TrainBatch:
    fields = routed_experts_fields(rows, b.prompt_mask.sum(-1).tolist(), b.prompts.shape[1], b.responses.shape[1])
    return TrainBatch(**{**{k: getattr(b, k) for k in b.__dataclass_fields__}, **fields})


def random_routing(b: TrainBatch, num_moe: int, experts: int, topk: int, seed: int, exclude=None) -> list:
    g = torch.Generator().manual_seed(seed)
    pool = [e for e in range(experts) if e != exclude]
    rows = []
    for row in range(len(b)):
        n = int(b.prompt_mask[row].sum() + b.response_mask[row].sum())
        choice = torch.stack([torch.randperm(len(pool), generator=g)[:topk] for _ in range(n * num_moe)])
        rows.append(torch.as_tensor(pool)[choice].view(n, num_moe, topk).to(torch.int16))
    return rows


def recorded_fields(actor, b: TrainBatch) -> TrainBatch:
    """The routing the actor's routers recorded in its last forward (one micro-batch per rank), as TrainBatch
    fields, summed over all ranks (DP ranks hold other rows, PP ranks other layers)."""
    from megatron.core import parallel_state as ps

    from megatron_dapo.actor.actor import local_micro_batches, seq_multiple
    from megatron_dapo.actor.router_replay import moe_layer_numbers

    replayer = actor.router_replay
    size, multiple = actor.cfg.log_prob_micro_batch_size_per_gpu, seq_multiple(actor.model_config)
    ranks, local, groups, mbs, _ = local_micro_batches(b, size, actor.cfg, actor.packed, multiple)
    assert len(mbs) == 1
    mb = mbs[0]
    rows = [ranks[ps.get_data_parallel_rank()][i] for i in groups[0]]
    numbers = moe_layer_numbers(actor.model_config)
    width, n_resp = b.prompts.shape[1], b.responses.shape[1]
    k = actor.model_config.moe_router_topk
    prompt = torch.zeros((len(b), width, len(numbers), k), dtype=torch.int64)
    response = torch.zeros((len(b), n_resp, len(numbers), k), dtype=torch.int64)
    s, rows_mb = mb.tokens.shape[1], mb.tokens.shape[0]
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    share = (
        s // tp
    )  # sequence parallelism: this TP rank's routers saw positions [share * tp_rank, share * (tp_rank + 1))
    for chunk in actor.chunks:
        for router, moe_layer in replayer._routers[id(chunk)]:
            rec = torch.zeros((rows_mb, s, k), dtype=torch.int64)
            local = router.router_replay.get_recorded_indices().view(share, rows_mb, k).transpose(0, 1).cpu()
            rec[:, share * tp_rank : share * (tp_rank + 1)] = local
            for j, row in enumerate(rows):
                p, r = int(b.prompt_mask[row].sum()), int(b.response_mask[row].sum())
                prompt[row, width - p :, moe_layer] = rec[j, :p]
                response[row, :r, moe_layer] = rec[j, p : p + r]
    dist.all_reduce(prompt)
    dist.all_reduce(response)
    fields = {"prompt_routed_experts": prompt.to(torch.int16), "response_routed_experts": response.to(torch.int16)}
    return TrainBatch(**{**{k: getattr(b, k) for k in b.__dataclass_fields__}, **fields})


def reached_by_flip(b: TrainBatch, flips: list[torch.Tensor]) -> torch.Tensor:
    """``[B, T]`` True where a routing flip sits at or before the position predicting the response token."""
    out = torch.zeros(b.responses.shape, dtype=torch.bool)
    for row, flip in enumerate(flips):  # flip: [n] bool per token (any MoE layer)
        p, r = int(b.prompt_mask[row].sum()), int(b.response_mask[row].sum())
        first = torch.cumsum(flip.int(), 0) > 0
        out[row, :r] = first[p - 1 : p - 1 + r]
    return out


def _masked(values: torch.Tensor, where: torch.Tensor, op: str) -> float:
    picked = values[where]
    return 0.0 if picked.numel() == 0 else float(getattr(picked, op)())


def mismatch(actor, hf64, hf_routing, moe_layers, b: TrainBatch, plain: torch.Tensor, scale: float) -> dict:
    """The rollout is ``hf64`` with every weight moved by ``scale`` x its std of noise, routing by itself."""
    mask = b.response_mask.bool()
    rollout_hf = copy.deepcopy(hf64)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in rollout_hf.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale * p.std().clamp(min=1e-3))
    rollout_gates = ForcedGates(rollout_hf, moe_layers)
    rollout_lp, rollout_routing = batch_log_probs(rollout_gates, rollout_hf, b)
    rollout_batch = with_routing(b, [r.to(torch.int16) for r in rollout_routing])
    with_replay = actor.compute_log_probs(rollout_batch, TEMPERATURE)["log_probs"]
    changed = [(r.sort(-1).values != h.sort(-1).values).any(-1) for r, h in zip(rollout_routing, hf_routing)]
    reached = reached_by_flip(b, [c.any(-1) for c in changed]) & mask  # [n, L] -> [n]
    before = (plain.double() - rollout_lp).abs()
    after = (with_replay.double() - rollout_lp).abs()
    return {
        "without": logprob_diff_metrics(plain, rollout_lp.float(), b.response_mask),
        "with": logprob_diff_metrics(with_replay, rollout_lp.float(), b.response_mask),
        "flipped_token_layers": sum(int(c.sum()) for c in changed),
        "token_layers": sum(int(c.numel()) for c in changed),
        "reached_tokens": int(reached.sum()),
        "response_tokens": int(mask.sum()),
        "unreached_max_change": _masked((with_replay - plain).abs(), mask & ~reached, "max"),
        "reached_diff_without": _masked(before, reached, "mean"),
        "reached_diff_with": _masked(after, reached, "mean"),
        "reached_max_without": _masked(before, reached, "max"),
        "reached_max_with": _masked(after, reached, "max"),
        "unreached_diff": _masked(before, mask & ~reached, "mean"),
    }


def main() -> None:
    """Each layout as a fresh job would see it: the process RNG as at start-up and a torchrun attempt number of its
    own, which names the default group's store prefix (``parallel.attempt_store``): nothing of the layout before is
    read again."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layouts", default="ep1-pp1")
    args = ap.parse_args()
    seed = torch.initial_seed()
    for k, layout in enumerate(args.layouts.split(",")):
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(k)
        torch.manual_seed(seed)
        run_layout(layout, os.path.join(args.out, layout))


def run_layout(layout: str, out: str) -> None:
    ep, pp, vpp, tp = re.fullmatch(r"ep(\d+)-pp(\d+)(?:-vpp(\d+))?(?:-tp(\d+)-sp)?", layout).groups()
    ep, pp, tp = int(ep), int(pp), int(tp or 1)

    from megatron_dapo.actor.actor import MegatronActor
    from megatron_dapo.actor.optimizer import build_optimizer
    from megatron_dapo.config import load_config
    from megatron_dapo.models.builder import build_gpt_chunks, wrap_for_training
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.parallel import init_distributed, init_model_parallel, teardown
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.weights.layout import hf_to_mcore, padded_vocab_size, unfuse_hf_experts
    from megatron_dapo.weights.model_io import load_full_tensors

    cfg = load_config(
        None,
        [
            f"parallel.expert_model_parallel_size={ep}",
            f"parallel.pipeline_model_parallel_size={pp}",
            *([f"parallel.virtual_pipeline_model_parallel_size={vpp}"] if vpp else []),
            f"parallel.tensor_model_parallel_size={tp}",
            f"parallel.sequence_parallel={str(tp > 1).lower()}",
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "actor.moe_aux_loss_coeff=0",
            "actor.router_replay=rollout",
            "actor.recompute=full",
            # one micro-batch per rank (recorded_fields reads one forward's record); VPP's schedule wants >= PP of them
            f"actor.log_prob_micro_batch_size_per_gpu={4 if vpp else 8}",
            "actor.ppo_micro_batch_size_per_gpu=2",
            "actor.optim.lr=1e-3",
        ],
    )
    info, _ = init_distributed(cfg.parallel)
    init_model_parallel(cfg.parallel, seed=1)
    hf = make_tiny_hf_model("qwen3_moe", seed=0, attn_implementation="eager")
    hf.config._experts_implementation = "eager"
    arch = model_arch_from_hf(hf.config.to_dict())
    padded = padded_vocab_size(arch.vocab_size, cfg.model.make_vocab_size_divisible_by, tp)
    weights = unfuse_hf_experts({n: p.detach() for n, p in hf.named_parameters()})
    chunks = build_gpt_chunks(arch, cfg.model, cfg.parallel, cfg.actor)
    load_full_tensors(chunks, arch, lambda m: hf_to_mcore(m, [weights[n] for n in m.hf], arch, padded))
    chunks = wrap_for_training(chunks, cfg.parallel)
    optimizer, _ = build_optimizer(chunks, cfg.actor.optim, total_steps=10)
    actor = MegatronActor(chunks, arch.vocab_size, cfg.actor, optimizer)
    assert actor.router_replay is not None

    moe_layers = moe_layer_indices(arch)
    hf64 = copy.deepcopy(hf).double()
    gates = ForcedGates(hf64, moe_layers)
    b = TrainBatch(**make_batch())
    mask = b.response_mask.bool()
    result: dict = {"layout": layout, "rank": info.rank}

    # 1. own routing: record, replay -> bit-identical.
    hf_own, hf_routing = batch_log_probs(gates, hf64, b)
    if vpp:  # several micro-batches: replay HF's own routing instead (the same, as the other layouts show)
        actor.router_replay.record()  # routes by itself
        plain = actor.compute_log_probs(b, TEMPERATURE)["log_probs"]
        actor.router_replay.clear()
        own = with_routing(b, [r.to(torch.int16) for r in hf_routing])
    else:
        actor.router_replay.record()
        plain = actor.compute_log_probs(b, TEMPERATURE)["log_probs"]
        own = recorded_fields(actor, b)
        actor.router_replay.clear()
    replayed = actor.compute_log_probs(own, TEMPERATURE)["log_probs"]
    result["own_max_abs"] = (replayed - plain)[mask].abs().max().item()
    own_rows = row_routings_from_fields(own)
    result["own_vs_hf_routing_equal"] = all(
        bool((a.long().sort(-1).values == h.long().sort(-1).values).all()) for a, h in zip(own_rows, hf_routing)
    )
    result["plain_vs_hf"] = (plain.double() - hf_own)[mask].abs().max().item()

    # 2. a forced random routing -> HF float64 with the same routing forced.
    forced_rows = random_routing(b, len(moe_layers), arch.num_experts, arch.moe_router_topk, seed=7)
    forced = actor.compute_log_probs(with_routing(b, forced_rows), TEMPERATURE)["log_probs"]
    hf_forced, _ = batch_log_probs(gates, hf64, b, forced_rows)
    result["forced_vs_hf"] = (forced.double() - hf_forced)[mask].abs().max().item()
    result["forced_vs_plain"] = (forced - plain)[mask].abs().max().item()

    # 3. mismatch: rollout = perturbed float64 copy with its own routing, at a few perturbation sizes.
    result["mismatch"] = {}
    for scale in (0.003, 0.01, 0.03):
        result["mismatch"][scale] = mismatch(actor, hf64, hf_routing, moe_layers, b, plain, scale)

    # 4. update with a routing that never picks UNUSED_EXPERT (recompute=full re-runs the routers in backward).
    unused_rows = random_routing(
        b, len(moe_layers), arch.num_experts, arch.moe_router_topk, seed=5, exclude=UNUSED_EXPERT
    )
    update_batch = with_routing(b, unused_rows)
    from megatron.core.transformer.moe.router_replay import RouterReplay

    actions: dict[str, int] = {}
    original = RouterReplay.get_replay_topk

    def counting(self, *a, **k):
        name = getattr(self.router_replay_action, "value", "none")
        actions[name] = actions.get(name, 0) + 1
        return original(self, *a, **k)

    RouterReplay.get_replay_topk = counting
    actor.compute_gradients(update_batch, TEMPERATURE)
    RouterReplay.get_replay_topk = original
    result["update_actions"] = actions
    result["expert_grads"] = expert_grad_norms(chunks, arch.num_experts // ep)
    metrics = actor.update(update_batch, TEMPERATURE).metrics
    result["update_ok"] = metrics["actor/update_ok"]
    result["pg_loss"] = metrics["actor/pg_loss"]
    os.makedirs(out, exist_ok=True)
    torch.save(result, os.path.join(out, f"rank{info.rank}.pt"))
    teardown(None)  # megatron-core's groups, then the default group: the next layout starts from none
    RouterReplay.clear_global_router_replay_instances()


if __name__ == "__main__":
    main()
