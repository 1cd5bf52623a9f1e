"""torchrun worker (world 1): activation recomputation (``actor.recompute``) changes memory, not numbers.

The tiny Qwen2 actor of tests/training/common.py is built the trainer's way once per setting (none, selective,
full with 1 and 2 layers per group) from the same seed, with dropout on (so the recomputed forward must replay the
same random masks: megatron-core saves and restores the RNG state around it). One train-mode forward/backward with a
token log-likelihood loss; recorded per setting: the logits, every parameter's ``main_grad``, the loss, and how many
times the first decoder layer and its core attention ran (recompute runs them again in the backward pass).
Writes ``<out>/result.json`` with max |diff| against ``none``; the test asserts.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from megatron_dapo.parallel import teardown

SETTINGS = {
    "none": (),
    "selective": ("actor.recompute=selective",),
    "full1": ("actor.recompute=full", "actor.recompute_num_layers=1"),
    "full2": ("actor.recompute=full", "actor.recompute_num_layers=2"),
}
DROPOUT = ("model.hidden_dropout=0.1", "model.attention_dropout=0.1")


def run(setting: tuple[str, ...], dropout_seed: int = 11) -> dict:
    from megatron_dapo.actor.actor import causal_mask
    from megatron_dapo.models.builder import unwrap
    from tests.training.common import build_actor, named_params

    cfg, chunks = build_actor("fp32", False, extra=setting + DROPOUT)
    model, core = chunks[0], unwrap(chunks[0])
    counts = {"layer0": 0, "core_attention0": 0}
    layer = core.decoder.layers[0]
    layer.register_forward_hook(lambda *a: counts.__setitem__("layer0", counts["layer0"] + 1))
    layer.self_attention.core_attention.register_forward_hook(
        lambda *a: counts.__setitem__("core_attention0", counts["core_attention0"] + 1)
    )
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 100, (2, 16), generator=g)
    targets = torch.randint(0, 100, (2, 16), generator=g)
    positions = torch.arange(16).unsqueeze(0).expand(2, -1)
    model.train()
    model.zero_grad_buffer()
    torch.manual_seed(dropout_seed)  # the dropout stream
    logits = model(tokens, positions, causal_mask(16, tokens.device))
    loss = -torch.log_softmax(logits.float(), -1).gather(-1, targets.unsqueeze(-1)).mean()
    loss.backward()
    model.finish_grad_sync()
    cfg_t = core.config
    return {
        "logits": logits.detach().clone(),
        "grads": {n: p.main_grad.detach().clone() for n, p in named_params(chunks)},
        "loss": float(loss),
        "counts": counts,
        "config": [cfg_t.recompute_granularity, cfg_t.recompute_method, cfg_t.recompute_num_layers],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    runs = {name: run(s) for name, s in SETTINGS.items()}
    base = runs["none"]
    out = {}
    for name, r in runs.items():
        out[name] = {
            "logits_max_diff": float((r["logits"] - base["logits"]).abs().max()),
            "grad_max_diff": max(float((r["grads"][n] - g).abs().max()) for n, g in base["grads"].items()),
            "grad_max_abs": max(float(g.abs().max()) for g in r["grads"].values()),
            "n_grads": len(r["grads"]),
            "loss": r["loss"],
            "counts": r["counts"],
            "config": r["config"],
        }
    # Dropout is on: another dropout stream changes the logits (so the equalities above are not trivially true).
    other = run(SETTINGS["none"], dropout_seed=12)
    out["other_dropout_logits_diff"] = float((other["logits"] - base["logits"]).abs().max())
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "result.json").write_text(json.dumps(out, indent=1))
    teardown(None)  # a live gloo group at interpreter exit can abort the process ("terminate called ...")


if __name__ == "__main__":
    main()
