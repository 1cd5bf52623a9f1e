"""``actor.use_remove_padding``: packed (THD) micro-batches give the padded path's log-probs, entropy, loss and
gradients, with less padding. The accelerator's packed attention kernel is replaced by a plain-torch reference (see
``packed_worker.py``); the packing, megatron-core's THD rotary embedding and the loss hook are the real code."""

from pathlib import Path

import pytest
import torch

from tests.distributed.loss_batch import make_batch
from tests.helpers.torchrun import run_torchrun

WORKER = Path(__file__).with_name("packed_worker.py")


def test_packed_equals_padded(tmp_path):
    run_torchrun(WORKER, 1, ["--out", str(tmp_path)], port=29769, timeout=600)
    res = torch.load(tmp_path / "result.pt")
    padded, packed = res[False], res[True]
    mask = make_batch()["response_mask"].bool()
    assert (packed["log_probs"][mask] - padded["log_probs"][mask]).abs().max() < 1e-5
    assert (packed["entropy"][mask] - padded["entropy"][mask]).abs().max() < 1e-5
    assert torch.all(packed["log_probs"][~mask] == 0)
    for key in ("actor/pg_loss", "actor/entropy", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert packed["metrics"][key] == pytest.approx(padded["metrics"][key], rel=1e-5, abs=1e-7), key
    worst = max(
        ((packed["grads"][n] - g).norm() / g.norm().clamp_min(1e-30)).item() for n, g in padded["grads"].items()
    )
    assert worst < 1e-5, worst
    # Packing removes the padding of rows shorter than their micro-batch's longest.
    assert 1.0 <= packed["padding_ratio"] < padded["padding_ratio"]
