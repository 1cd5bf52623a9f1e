"""Write ``tests/fixtures/verl_golden_distillation.json.gz``: on-policy distillation cases computed by verl 0.9.1's
own functions (``verl/trainer/distillation/losses.py``, ``verl/trainer/distillation/megatron/losses.py``).

``tests/algo/test_distillation_golden.py`` replays every case against ``megatron_dapo/distill/``; it only reads the
golden file, so CI does not need verl. Setting verl up outside the project's virtual environment (nothing goes into
``.venv``; the same packages as ``tests/fixtures/make_verl_golden.py``)::

    .venv/bin/python -m pip install --no-deps --target /tmp/verl091 verl==0.9.1 omegaconf \\
        antlr4-python3-runtime==4.9.3 codetiming tensordict pyvers cloudpickle orjson ray
    PYTHONPATH=/tmp/verl091 .venv/bin/python tools/make_distillation_golden.py

What runs: verl's ``distillation_loss`` (the distillation term alone) and ``distillation_ppo_loss`` (its sum with the
task's PPO loss, ``verl/workers/utils/losses.py``'s ``ppo_loss``), each on fresh leaf tensors, then ``backward``.
The top-k case's per-token loss comes from verl's Megatron ``_VocabParallelKLDivergence`` (its forward and its own
backward) on a world-of-one gloo group with megatron-core's ``parallel_state`` at TP=1 (what Megatron's
``compute_forward_kl_topk`` calls after its context-parallel split, a no-op at CP=1). Three things are bypassed, none
of them arithmetic: ``verl/__init__.py`` and ``verl/utils/dataset/__init__.py`` (their imports pull in ``datasets``;
empty packages stand in, whose ``__path__`` is the installed tree), and ``no_padding_2_padding`` (the unpacking of
verl's packed THD layout), replaced by the identity since every tensor here is given padded ``[B, T]``.

Each case varies the loss mode (every registered name and alias), the two uses (``use_policy_gradient``), with and
without task rewards, ``loss_max_clamp`` and ``log_prob_min_clamp`` on and off, the four aggregation modes with the
global token and sequence counts of a larger batch, the clip ratios (``None`` falls back to ``clip_ratio``) and, in
every fifth case, the rollout's truncated IS weights.
Inputs are rounded to 4 decimals (the test rebuilds bit-identical float32 tensors); outputs keep 9 significant
digits.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import torch

VERL_VERSION = "0.9.1"
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "tests" / "fixtures" / "verl_golden_distillation.json.gz"
SEED = 44
DECIMALS = 4
AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
ESTIMATOR_MODES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
ACTOR_CLIP = (0.2, 0.28)  # the task loss's clip ratios (verl's actor section; dual clip 3)
TOPK_SHAPE = (3, 5, 16, 4)  # B, T, V, K


# ----------------------------------------------------------------------------------------------------- verl
def import_verl() -> dict[str, Any]:
    """verl's distillation modules, with the bypasses of the docstring, and megatron-core at TP=1."""
    root = next(
        (Path(p or ".") / "verl" for p in sys.path if (Path(p or ".") / "verl/trainer/distillation").is_dir()), None
    )
    if root is None:
        raise SystemExit("verl 0.9.1 sources not found on PYTHONPATH (see this script's docstring)")
    version = (root / "version" / "version").read_text().strip()
    if version != VERL_VERSION:
        raise SystemExit(f"found verl {version} at {root}, need {VERL_VERSION}")
    for name, sub in (("verl", ""), ("verl.utils.dataset", "utils/dataset")):
        package = types.ModuleType(name)
        package.__path__ = [str(root / sub)]
        sys.modules[name] = package
    import torch.distributed as dist
    import verl.trainer.distillation.losses as losses
    import verl.trainer.distillation.megatron.losses as megatron_losses
    import verl.utils.tensordict_utils as tu
    import verl.workers.utils.losses as worker_losses
    from megatron.core import parallel_state
    from tensordict import TensorDict
    from verl.workers.config import ActorConfig, DistillationConfig, DistillationLossConfig, PolicyLossConfig

    def identity(tensor: torch.Tensor, data: Any) -> torch.Tensor:
        return tensor

    losses.no_padding_2_padding = identity
    worker_losses.no_padding_2_padding = identity
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29561", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    return {
        "losses": losses, "kl_function": megatron_losses._VocabParallelKLDivergence, "tu": tu,
        "TensorDict": TensorDict, "ActorConfig": ActorConfig, "DistillationConfig": DistillationConfig,
        "DistillationLossConfig": DistillationLossConfig, "PolicyLossConfig": PolicyLossConfig,
    }  # fmt: skip


# ----------------------------------------------------------------------------------------------------- encoding
def rounded(array: np.ndarray) -> list:
    return np.round(np.asarray(array, dtype=np.float64), DECIMALS).tolist()


def f32(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def encode(t: Any) -> Any:
    """A tensor or number as nested lists of floats with 9 significant digits."""
    arr = torch.as_tensor(t).detach().to(torch.float64).numpy()
    fmt = np.vectorize(lambda x: float(f"{x:.9g}"), otypes=[object])
    return float(f"{float(arr):.9g}") if arr.ndim == 0 else fmt(arr).tolist()


def metric_value(value: Any) -> float:
    return float(value.aggregate()) if hasattr(value, "aggregate") else float(value)


# ----------------------------------------------------------------------------------------------------- inputs
def response_mask(rng: np.random.Generator, batch: int, width: int, holes: bool) -> np.ndarray:
    """Right-padded rows (one fully masked when ``holes``), with masked spans inside responses when ``holes``."""
    lengths = rng.integers(1, width + 1, size=batch)
    if holes:
        lengths[rng.integers(1, batch)] = 0
    mask = (np.arange(width)[None, :] < lengths[:, None]).astype(np.float64)
    if holes:
        mask *= rng.random((batch, width)) >= 0.25
        mask[0, 0] = 1.0  # at least one token: verl's loss range is a min over the tokens
    return mask


def estimator_inputs(rng: np.random.Generator, variant: int) -> dict[str, Any]:
    batch, width = 4, 6
    mask = response_mask(rng, batch, width, holes=variant % 2 == 1)
    student = -np.exp(rng.normal(-0.5, 1.0, size=(batch, width)))
    diff = rng.normal(0.0, 1.5, size=(batch, width))
    rows, cols = np.nonzero(mask)
    pick = rng.integers(len(rows))
    diff[rows[pick], cols[pick]] = -25.0  # a token the teacher finds unlikely: beyond low_var_kl's +-20 clamp
    return {
        "response_mask": rounded(mask),
        "student_log_probs": rounded(student),
        "teacher_log_probs": rounded(np.minimum(student + diff, -1e-4)),
        "old_log_probs": rounded(student + rng.normal(0.0, 0.3, size=(batch, width))),
        "advantages": rounded(np.repeat(rng.normal(0.0, 1.0, size=(batch, 1)), width, axis=1)),
    }


def topk_inputs(rng: np.random.Generator, variant: int) -> dict[str, Any]:
    batch, width, vocab, k = TOPK_SHAPE
    logits = rng.normal(0.0, 2.5, size=(batch, width, vocab))
    teacher = torch.log_softmax(torch.tensor(rng.normal(0.0, 2.5, size=(batch, width, vocab))), dim=-1)
    values, ids = teacher.topk(k, dim=-1)
    student = torch.log_softmax(torch.tensor(logits), dim=-1)
    sampled = torch.tensor(rng.integers(0, vocab, size=(batch, width)))
    student_lp = student.gather(-1, sampled[..., None])[..., 0].numpy()
    return {
        "response_mask": rounded(response_mask(rng, batch, width, holes=variant % 2 == 1)),
        "student_logits": rounded(logits),
        "teacher_topk_log_probs": rounded(values.numpy()),
        "teacher_topk_ids": ids.tolist(),
        "student_log_probs": rounded(student_lp),
        "old_log_probs": rounded(student_lp + rng.normal(0.0, 0.3, size=(batch, width))),
        "advantages": rounded(np.repeat(rng.normal(0.0, 1.0, size=(batch, 1)), width, axis=1)),
    }


# ----------------------------------------------------------------------------------------------------- cases
def settings(rng: np.random.Generator, index: int, mode: str, pg: bool, clamps: bool) -> dict[str, Any]:
    """One case's settings: the loss section's keys, the aggregation and the step's global counts."""
    clip = [(0.2, 0.2, 0.2), (0.2, 0.1, 0.3), (0.25, None, None)][index % 3]
    return {
        "loss_mode": mode,
        "use_policy_gradient": pg,
        "use_task_rewards": index % 4 != 3,
        "distillation_loss_coef": round(float(rng.uniform(0.1, 2.0)), DECIMALS),
        "loss_max_clamp": (1.0 if mode == "forward_kl_topk" else 0.5) if clamps else None,
        "log_prob_min_clamp": -3.0 if clamps else None,  # the estimators ignore it (as verl)
        "topk": TOPK_SHAPE[3],
        "clip_ratio": clip[0],
        "clip_ratio_low": clip[1],
        "clip_ratio_high": clip[2],
        "loss_agg_mode": AGG_MODES[index % len(AGG_MODES)],
        "extra_tokens": 7 if index % 2 else 0,  # the step's counts: this micro-batch's, or those of a larger batch
        "extra_seqs": 2 if index % 2 else 0,
        "loss_scale_factor": 8 if index % 3 == 1 else None,
    }


def make_cases(rng: np.random.Generator) -> list[dict[str, Any]]:
    cases = []
    for mode in ESTIMATOR_MODES:
        for pg in (False, True):
            if mode in ("k1", "kl") and not pg:
                continue  # verl refuses it (see "refusals")
            for clamps in (False, True):
                index = len(cases)
                cases.append({"name": f"{mode}_pg{int(pg)}_clamp{int(clamps)}",
                              "settings": settings(rng, index, mode, pg, clamps),
                              "inputs": estimator_inputs(rng, index)})  # fmt: skip
    for pg in (False, True):
        for clamps in (False, True):
            for index_shift in (0, 1):
                index = len(cases) + index_shift
                s = settings(rng, index, "forward_kl_topk", pg, clamps)
                if index_shift:  # the two clamps apart
                    s["loss_max_clamp"] = None
                cases.append({"name": f"forward_kl_topk_pg{int(pg)}_clamp{int(clamps)}_{index_shift}",
                              "settings": s, "inputs": topk_inputs(rng, index)})  # fmt: skip
    for index, case in enumerate(cases):
        if index % 5 == 4:  # truncated IS weights of the rollout: both policy losses weight their tokens with them
            shape = np.asarray(case["inputs"]["response_mask"]).shape
            case["inputs"]["rollout_is_weights"] = rounded(np.minimum(rng.lognormal(0.0, 0.5, size=shape), 2.0))
    return cases


def _loss_config(v: dict[str, Any], s: dict[str, Any]) -> Any:
    keys = ("loss_mode", "use_policy_gradient", "use_task_rewards", "distillation_loss_coef", "loss_max_clamp",
            "log_prob_min_clamp", "topk", "clip_ratio", "clip_ratio_low", "clip_ratio_high")  # fmt: skip
    return v["DistillationLossConfig"](**{k: s[k] for k in keys})


def _model_output(v: dict[str, Any], inputs: dict[str, Any], s: dict[str, Any]) -> tuple[dict, dict]:
    """Fresh leaves (the student's log-probs, and logits for top-k) and verl's ``model_output`` from them."""
    leaves = {"student_log_probs": f32(inputs["student_log_probs"]).requires_grad_(True)}
    output = {"log_probs": leaves["student_log_probs"]}
    if "student_logits" in inputs:
        leaves["student_logits"] = f32(inputs["student_logits"]).requires_grad_(True)
        names = ("distillation_losses", "student_mass", "teacher_mass", "overlap_count", "overlap_token_advantage")
        values = v["kl_function"].apply(
            leaves["student_logits"], f32(inputs["teacher_topk_log_probs"]),
            torch.tensor(inputs["teacher_topk_ids"], dtype=torch.long), s["log_prob_min_clamp"],
        )  # fmt: skip
        output.update(zip(names, values))
    return leaves, output


def _data(v: dict[str, Any], inputs: dict[str, Any], s: dict[str, Any]) -> Any:
    mask = f32(inputs["response_mask"])
    fields = {"response_mask": mask, "old_log_probs": f32(inputs["old_log_probs"]),
              "advantages": f32(inputs["advantages"])}  # fmt: skip
    if "teacher_log_probs" in inputs:
        fields["teacher_logprobs"] = f32(inputs["teacher_log_probs"]).unsqueeze(-1)
    if "rollout_is_weights" in inputs:
        fields["rollout_is_weights"] = f32(inputs["rollout_is_weights"])
    data = v["TensorDict"](fields, batch_size=[mask.shape[0]])
    v["tu"].assign_non_tensor(
        data, dp_size=1, batch_num_tokens=int(mask.sum()) + s["extra_tokens"],
        global_batch_size=int((mask.sum(-1) > 0).sum()) + s["extra_seqs"],
    )  # fmt: skip
    return data


def run_case(v: dict[str, Any], case: dict[str, Any]) -> dict[str, Any]:
    """verl's distillation term alone and its sum with the task loss: values, metrics, gradients."""
    s, inputs = case["settings"], case["inputs"]
    actor = v["ActorConfig"](
        strategy="megatron", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=ACTOR_CLIP[0],
        clip_ratio_low=ACTOR_CLIP[0], clip_ratio_high=ACTOR_CLIP[1], loss_agg_mode=s["loss_agg_mode"],
        loss_scale_factor=s["loss_scale_factor"], policy_loss=v["PolicyLossConfig"](loss_mode="vanilla"),
    )  # fmt: skip
    config = v["DistillationConfig"](enabled=False, distillation_loss=_loss_config(v, s))
    out = {}
    for which, fn in (("distill", v["losses"].distillation_loss), ("total", v["losses"].distillation_ppo_loss)):
        leaves, model_output = _model_output(v, inputs, s)
        loss, metrics = fn(actor, config, model_output, _data(v, inputs, s))
        loss.backward()
        out[which] = {
            "loss": encode(loss),
            "metrics": {k: encode(metric_value(m)) for k, m in sorted(metrics.items())},
            "grads": {k: encode(t.grad if t.grad is not None else torch.zeros_like(t)) for k, t in leaves.items()},
        }
    return out


def refusals(v: dict[str, Any]) -> list[dict[str, Any]]:
    """Loss sections verl's ``DistillationLossConfig`` refuses (and one it accepts, as a control)."""
    out = []
    for keys in ({"loss_mode": "k1", "use_policy_gradient": False}, {"loss_mode": "kl", "use_policy_gradient": False},
                 {"loss_mode": "k3", "use_policy_gradient": True, "policy_loss_mode": "gspo"},
                 {"loss_mode": "k4", "use_policy_gradient": False},
                 {"loss_mode": "k3", "use_policy_gradient": False}):  # fmt: skip
        try:
            v["DistillationLossConfig"](**keys)
            refused = None
        except Exception as exc:  # noqa: BLE001 - recorded: which sections verl refuses
            refused = type(exc).__name__
        out.append({"settings": keys, "refused": refused})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.manual_seed(SEED)
    v = import_verl()
    cases = make_cases(np.random.default_rng(SEED))
    for case in cases:
        case["verl"] = run_case(v, case)
    golden = {"verl_version": VERL_VERSION, "cases": cases, "refusals": refusals(v)}
    payload = json.dumps(golden, separators=(",", ":"), sort_keys=True).encode()
    args.out.write_bytes(gzip.compress(payload, compresslevel=9, mtime=0))
    print(f"wrote {len(cases)} cases to {args.out} ({args.out.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
