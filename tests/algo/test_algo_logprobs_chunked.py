"""``response_log_probs``: chunked log-probs/entropy at response positions vs the gathered path and float64.

References: ``vocab_parallel_log_probs`` on the logits gathered at the response positions (the path it replaces) and
an independent float64 ``log_softmax`` over the true vocabulary with autograd gradients. Tolerances are relative to
the largest reference magnitude (fp32 arithmetic: 1e-6; bf16 gradients are rounded to bf16: one bf16 ulp).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_dapo.algo.logprobs import response_log_probs, vocab_parallel_log_probs
from tests.helpers import run_torchrun

FP32_REL = 1e-6
BF16_REL = 2.0**-8
WORKER = Path(__file__).with_name("logprobs_chunked_worker.py")
TP_PORT = 29745  # algo area: 29740-29749

B, S, V_PADDED, TRUE_VOCAB, T = 2, 12, 40, 37, 9


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).abs().max() / ref.double().abs().max().clamp(min=1e-30)).item()


def make_case(dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Two rows; row 1's last response positions are clamped onto the last logit row (as the actor does for
    padding), so several tokens share a row; padded vocabulary columns hold huge values that must not leak."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V_PADDED, generator=g, dtype=torch.float64) * 3
    logits[..., TRUE_VOCAB:] = 1e4
    index = torch.stack([torch.arange(2, 2 + T), (torch.arange(T) + 5).clamp(max=S - 1)])
    tokens = torch.randint(0, TRUE_VOCAB, (B, T), generator=g)
    return {
        "logits": logits.to(dtype),
        "index": index,
        "tokens": tokens,
        "w_lp": torch.randn(B, T, generator=g, dtype=torch.float64),
        "w_ent": torch.randn(B, T, generator=g, dtype=torch.float64),
    }


def float64_reference(case: dict, temperature: float, entropy_grad: bool) -> tuple:
    """log_softmax over the true vocabulary in float64 on the gathered rows; gradient of Σ w·logp (+ Σ w·H)."""
    x = case["logits"].double().requires_grad_(True)
    rows = torch.gather(x, 1, case["index"].unsqueeze(-1).expand(-1, -1, V_PADDED))[..., :TRUE_VOCAB]
    log_p = torch.log_softmax(rows / temperature, dim=-1)
    logp = log_p.gather(-1, case["tokens"].unsqueeze(-1)).squeeze(-1)
    ent = -(log_p.exp() * log_p).sum(-1)
    objective = (logp * case["w_lp"]).sum() + ((ent * case["w_ent"]).sum() if entropy_grad else 0.0)
    objective.backward()
    return logp.detach(), ent.detach(), x.grad


def gathered_path(case: dict, temperature: float, entropy_grad: bool) -> tuple:
    """The path being replaced: gather the response rows, then ``vocab_parallel_log_probs``."""
    x = case["logits"].clone().requires_grad_(True)
    rows = torch.gather(x, 1, case["index"].unsqueeze(-1).expand(-1, -1, V_PADDED))
    logp, ent = vocab_parallel_log_probs(rows, case["tokens"], TRUE_VOCAB, temperature)
    _backward(logp, ent, case, entropy_grad)
    return logp.detach(), ent.detach(), x.grad


def chunked_path(case: dict, temperature: float, entropy_grad: bool, chunk: int, into_logits: bool = False):
    x = case["logits"].clone().requires_grad_(True)
    y = x * 1  # a non-leaf whose storage the gradient may take
    logp, ent = response_log_probs(
        y,
        case["index"],
        case["tokens"],
        TRUE_VOCAB,
        temperature,
        chunk_tokens=chunk,
        entropy_requires_grad=entropy_grad,
        grad_into_logits=into_logits,
    )
    assert ent.requires_grad == entropy_grad
    _backward(logp, ent, case, entropy_grad)
    return logp.detach(), ent.detach(), x.grad


def _backward(logp, ent, case, entropy_grad) -> None:
    objective = (logp * case["w_lp"].to(logp.dtype)).sum()
    if entropy_grad:
        objective = objective + (ent * case["w_ent"].to(ent.dtype)).sum()
    objective.backward()


@pytest.mark.parametrize("chunk", [1, 5, 64])  # one row, a non-divisor of the 16 distinct rows, more than T
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_fp32_matches_gathered_path_and_float64(chunk: int, temperature: float, entropy_grad: bool) -> None:
    case = make_case(torch.float32)
    ref = float64_reference(case, temperature, entropy_grad)
    old = gathered_path(case, temperature, entropy_grad)
    new = chunked_path(case, temperature, entropy_grad, chunk)
    assert new[0].dtype == torch.float32 and new[2].dtype == torch.float32
    for got, want, name in zip(new, ref, ("log_probs", "entropy", "grad"), strict=True):
        assert rel_err(got, want) <= FP32_REL, name
    # The gathered path is itself only fp32-accurate (its entropy is ~1e-6 off float64 at T=0.7): the two paths
    # may differ by at most both their errors.
    for got, want, want64, name in zip(new, old, ref, ("log_probs", "entropy", "grad"), strict=True):
        assert rel_err(got, want) <= FP32_REL + rel_err(want, want64), name
    # Only the response rows' real columns carry gradient; padded columns and other rows are exactly zero.
    response_rows = torch.zeros(B, S, dtype=torch.bool)
    response_rows.scatter_(1, case["index"], True)
    assert new[2][~response_rows].abs().max().item() == 0.0
    assert new[2][..., TRUE_VOCAB:].abs().max().item() == 0.0


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_bf16_logits(entropy_grad: bool) -> None:
    case = make_case(torch.bfloat16)
    ref = float64_reference(case, 0.7, entropy_grad)  # on the bf16 values themselves
    old = gathered_path(case, 0.7, entropy_grad)
    new = chunked_path(case, 0.7, entropy_grad, chunk=4)
    assert new[0].dtype == torch.float32 and new[2].dtype == torch.bfloat16
    assert rel_err(new[0], ref[0]) <= FP32_REL
    assert rel_err(new[1], ref[1]) <= FP32_REL
    assert rel_err(new[0], old[0]) <= FP32_REL + rel_err(old[0], ref[0])
    assert rel_err(new[1], old[1]) <= FP32_REL + rel_err(old[1], ref[1])
    # bf16 gradients: each element within one bf16 rounding of the float64 gradient.
    assert ((new[2].double() - ref[2]).abs() <= BF16_REL * ref[2].abs() + 1e-30).all()
    assert rel_err(new[2], old[2]) <= BF16_REL


@pytest.mark.parametrize("entropy_grad", [True, False])
def test_gradient_written_into_logits_storage(entropy_grad: bool) -> None:
    case = make_case(torch.float32)
    ref = float64_reference(case, 0.7, entropy_grad)
    x = case["logits"].clone().requires_grad_(True)
    y = x * 1
    seen = {}

    def keep_grad(grad: torch.Tensor) -> None:
        seen["same_storage"] = grad.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()

    y.register_hook(keep_grad)
    logp, ent = response_log_probs(
        y, case["index"], case["tokens"], TRUE_VOCAB, 0.7, chunk_tokens=3, entropy_requires_grad=entropy_grad,
        grad_into_logits=True,
    )  # fmt: skip
    _backward(logp, ent, case, entropy_grad)
    assert seen["same_storage"]
    assert rel_err(x.grad, ref[2]) <= FP32_REL
    assert rel_err(logp, ref[0]) <= FP32_REL


def test_entropy_off_and_detached() -> None:
    case = make_case(torch.float32)
    logp, ent = response_log_probs(case["logits"], case["index"], case["tokens"], TRUE_VOCAB, with_entropy=False)
    assert ent is None
    ref = float64_reference(case, 1.0, False)
    assert rel_err(logp, ref[0]) <= FP32_REL
    x = case["logits"].clone().requires_grad_(True)
    logp, ent = response_log_probs(x, case["index"], case["tokens"], TRUE_VOCAB, entropy_requires_grad=False)
    assert logp.requires_grad and not ent.requires_grad and ent.grad_fn is None
    assert rel_err(ent, ref[1]) <= FP32_REL


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 4, 6, generator=g, dtype=torch.float64).requires_grad_(True)
    index = torch.tensor([[1, 2, 3, 3]])  # the last row scores two tokens
    tokens = torch.tensor([[0, 4, 2, 1]])

    def fn(x: torch.Tensor) -> tuple:
        return response_log_probs(x, index, tokens, true_vocab_size=5, temperature=0.8, chunk_tokens=2)

    assert torch.autograd.gradcheck(fn, (logits,), eps=1e-6, atol=1e-8, rtol=1e-6)


class _LargestNewTensor(TorchDispatchMode):
    """Largest number of elements of any op output that does not share the watched tensor's storage."""

    def __init__(self, watched: torch.Tensor) -> None:
        super().__init__()
        self.watched_ptr = watched.untyped_storage().data_ptr()
        self.largest = 0
        self.recording = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if self.recording and isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() != self.watched_ptr:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_tensor_larger_than_a_chunk() -> None:
    """Forward and backward (gradient into the logits' storage) allocate nothing bigger than ``chunk × V``."""
    chunk, s, v, t = 4, 64, 50, 48
    logits = torch.randn(1, s, v, requires_grad=True)
    y = logits * 1
    index = torch.arange(s - t, s).unsqueeze(0)
    tokens = torch.randint(0, v, (1, t))
    with _LargestNewTensor(y) as probe:
        # Stop once the gradient w.r.t. ``y`` exists: what autograd does upstream of ``y`` is not ours.
        y.register_hook(lambda grad: setattr(probe, "recording", False))
        logp, ent = response_log_probs(y, index, tokens, v, 0.9, chunk_tokens=chunk, grad_into_logits=True)
        (logp.sum() + ent.sum()).backward()
    assert probe.largest <= chunk * v
    assert logits.grad[:, : s - t].abs().max().item() == 0.0


def test_rejects_bad_arguments() -> None:
    case = make_case()
    with pytest.raises(ValueError, match="temperature"):
        response_log_probs(case["logits"], case["index"], case["tokens"], TRUE_VOCAB, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        response_log_probs(case["logits"], case["index"], case["tokens"], TRUE_VOCAB, chunk_tokens=0)
    with pytest.raises(ValueError, match="expected logits"):
        response_log_probs(case["logits"][0], case["index"], case["tokens"], TRUE_VOCAB)


def test_tensor_parallel_two_ranks_match_single_process(tmp_path: Path) -> None:
    """2 ranks, vocabulary split in two (rank 1's shard ends in padding; in one case it is padding only)."""
    run_torchrun(WORKER, 2, ["--out", str(tmp_path)], port=TP_PORT, timeout=240)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for rank, res in enumerate(results):
        assert len(res) == 8, rank
        for name, errs in res.items():
            for key, err in errs.items():
                tol = BF16_REL if (name.startswith("bf16") and key == "grad") else FP32_REL
                assert err <= tol, f"rank {rank} {name} {key}: {err}"
