"""Benchmark of the algorithm math and the math_dapo reward.

(a) GRPO advantages + the DAPO loss (``algo/loss.py:dapo_loss``, per micro-batch of 16 rows as the actor's hook
    runs it) on a 512 x 4096 fp32 batch (groups of 16) vs a straightforward reference (verl-style
    per-response/per-group loop for the advantages, per-row loop for the policy loss), forward only, same run;
    prints ``algo_vs_reference=<ours/reference>`` (< 1 = faster).
(b) math_dapo scoring of a generated corpus of 10k responses (correct/wrong, ``Answer:`` lines, boxed answers,
    fractions, long reasoning, no answer): prints ``reward_per_s`` (in-process scorer) and
    ``reward_manager_per_s`` (decode + process pool of 2 workers).

Usage: ``python benchmarks/algo.py [--quick]`` (CPU; < 2 minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import random
import time
from collections import defaultdict

import torch

from megatron_dapo.algo.advantages import compute_grpo_advantages
from megatron_dapo.algo.loss import LossNormalisers, dapo_loss
from megatron_dapo.config import ActorConfig, RewardConfig
from megatron_dapo.reward import math_dapo
from megatron_dapo.reward.manager import RewardManager

LOW, HIGH, C = 0.2, 0.28, 10.0
MICRO_BATCH_ROWS = 16  # the loss hook sees one micro-batch at a time


def make_batch(b: int, t: int, n: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1)).float()
    log_prob = -torch.rand(b, t, generator=g) * 4
    return {
        "scores": torch.randint(0, 2, (b,), generator=g).float() * 2 - 1,
        "group_ids": [f"prompt-{i // n}" for i in range(b)],
        "mask": mask,
        "log_prob": log_prob,
        "old_log_prob": log_prob + 0.05 * torch.randn(b, t, generator=g),
    }


def ours(batch: dict) -> torch.Tensor:
    """GRPO advantages, then the training loss function (``dapo_loss``) micro-batch by micro-batch with the batch's
    global normalisers, as the actor's loss hook runs it."""
    mask = batch["mask"]
    adv, _ = compute_grpo_advantages(batch["scores"], batch["group_ids"], mask)
    cfg = ActorConfig(clip_ratio_low=LOW, clip_ratio_high=HIGH, clip_ratio_c=C, loss_agg_mode="token-mean")
    norm = LossNormalisers.of(mask)
    loss = torch.zeros(())
    for start in range(0, mask.shape[0], MICRO_BATCH_ROWS):
        rows = slice(start, start + MICRO_BATCH_ROWS)
        part, _ = dapo_loss(
            batch["log_prob"][rows],
            None,
            loss_mask=mask[rows],
            response_mask=mask[rows],
            advantages=adv[rows],
            cfg=cfg,
            norm=norm,
            old_log_probs=batch["old_log_prob"][rows],
        )
        loss = loss + part
    return loss


def reference(batch: dict) -> torch.Tensor:
    """verl-style loops: a dict of per-group score lists, then one row at a time for the loss."""
    scores, ids, mask = batch["scores"].clone(), batch["group_ids"], batch["mask"]
    id2score = defaultdict(list)
    for i in range(scores.shape[0]):
        id2score[ids[i]].append(scores[i])
    id2mean, id2std = {}, {}
    for g, vals in id2score.items():
        stacked = torch.stack(vals)
        id2mean[g] = torch.mean(stacked) if len(vals) > 1 else torch.tensor(0.0)
        id2std[g] = torch.std(stacked) if len(vals) > 1 else torch.tensor(1.0)
    for i in range(scores.shape[0]):
        scores[i] = (scores[i] - id2mean[ids[i]]) / (id2std[ids[i]] + 1e-6)
    adv = scores.unsqueeze(-1) * mask
    total = torch.zeros(())
    for i in range(adv.shape[0]):
        ratio = torch.exp(torch.clamp(batch["log_prob"][i] - batch["old_log_prob"][i], -20, 20))
        l1 = -adv[i] * ratio
        l2 = -adv[i] * torch.clamp(ratio, 1 - LOW, 1 + HIGH)
        clipped = torch.maximum(l1, l2)
        dual = torch.minimum(clipped, -adv[i] * C)
        token_loss = torch.where(adv[i] < 0, dual, clipped)
        total = total + (token_loss * mask[i]).sum()
    return total / mask.sum()


def timed_pair(batch: dict, repeats: int) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Best-of-``repeats`` wall time of ours and of the reference, interleaved so that load from other processes
    on a shared machine affects both alike."""
    ours(batch), reference(batch)  # warm-up
    best_ours = best_ref = float("inf")
    out_ours = out_ref = None
    for _ in range(repeats):
        start = time.perf_counter()
        out_ours = ours(batch)
        best_ours = min(best_ours, time.perf_counter() - start)
        start = time.perf_counter()
        out_ref = reference(batch)
        best_ref = min(best_ref, time.perf_counter() - start)
    return best_ours, best_ref, out_ours, out_ref


# ----------------------------------------------------------------------------- reward corpus


def make_corpus(size: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = random.Random(seed)
    filler = ["Let x be the unknown.", "We expand the square.", "By symmetry,", "Thus", "so that", "Note that"]
    corpus = []
    for _ in range(size):
        truth_kind = rng.random()
        if truth_kind < 0.5:
            truth = str(rng.randint(0, 10 ** rng.randint(1, 6)))
        elif truth_kind < 0.8:
            truth = f"\\frac{{{rng.randint(1, 99)}}}{{{rng.randint(2, 99)}}}"
        else:
            truth = f"{rng.randint(1, 9)}\\sqrt{{{rng.randint(2, 20)}}}"
        answer = truth if rng.random() < 0.5 else str(rng.randint(0, 999))
        reasoning = " ".join(rng.choice(filler) for _ in range(rng.randint(5, 300)))
        form = rng.randrange(5)
        if form == 0:
            tail = f"Answer: {answer}"
        elif form == 1:
            tail = f"Answer: $\\boxed{{{answer}}}$"
        elif form == 2:
            tail = f"The final answer is \\boxed{{{answer}}}."
        elif form == 3:
            tail = f"answer : {answer} degrees\nDone."
        else:
            tail = f"Answer: x = {answer}"
        corpus.append((f"{reasoning}\n{tail}", truth))
    return corpus


class CharTokenizer:
    eos_token = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def bench_rewards(size: int) -> tuple[float, float]:
    corpus = make_corpus(size)
    start = time.perf_counter()
    for solution, truth in corpus:
        math_dapo.compute_score(solution, truth)
    in_process = size / (time.perf_counter() - start)

    width = max(len(s) for s, _ in corpus)
    ids = torch.zeros(size, width, dtype=torch.long)
    mask = torch.zeros(size, width, dtype=torch.long)
    for i, (solution, _) in enumerate(corpus):
        ids[i, : len(solution)] = torch.tensor([ord(c) for c in solution])
        mask[i, : len(solution)] = 1
    with RewardManager(CharTokenizer(), RewardConfig(num_workers=2), max_response_length=width) as manager:
        manager(ids[:4], mask[:4], ["math_dapo"] * 4, [t for _, t in corpus[:4]])  # start the pool
        start = time.perf_counter()
        result = manager(ids, mask, ["math_dapo"] * size, [t for _, t in corpus])
        pooled = size / (time.perf_counter() - start)
    assert result.metrics["reward/num_errors"] == 0
    return in_process, pooled


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller batch and corpus (smoke test)")
    args = parser.parse_args()
    b, t, repeats, corpus = (64, 512, 2, 1000) if args.quick else (512, 4096, 5, 10_000)

    batch = make_batch(b, t, n=16)
    with torch.no_grad():
        t_ours, t_ref, out_ours, out_ref = timed_pair(batch, repeats)
    torch.testing.assert_close(out_ours, out_ref, rtol=1e-4, atol=1e-6)
    print(
        f"batch={b}x{t} fp32 groups_of=16 threads={torch.get_num_threads()} best_of={repeats} "
        f"ours_s={t_ours:.4f} reference_s={t_ref:.4f} loss={out_ours.item():.6f}"
    )
    print(f"algo_vs_reference={t_ours / t_ref:.4f}")

    in_process, pooled = bench_rewards(corpus)
    print(f"corpus={corpus} reward_manager_per_s={pooled:.0f}")
    print(f"reward_per_s={in_process:.0f}")


if __name__ == "__main__":
    main()
