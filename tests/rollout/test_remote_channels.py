"""The async job's store channels (``rollout/remote.py``) on a real torch.distributed store (``HashStore``, the same
key-value API as the job's TCPStore): the queue keeps order and its length across producer and consumer objects, a
snapshot reads the waiting groups without taking them, a missing group or message fails with the setting to raise;
a bridge message's tensors keep their dtypes. The bridge and the whole protocol run in the multi-process tests of
``tests/e2e/test_async_e2e.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_dapo.rollout.remote import Control, StoreQueue, pack_weights, packed_bytes, unpack_weights


def test_queue_order_length_and_snapshot_view():
    store = dist.HashStore()
    producer, consumer = StoreQueue(store, timeout_s=5), StoreQueue(store, timeout_s=5)
    for i in range(3):
        producer.put(f"group {i}".encode())
    assert producer.length() == consumer.length() == 3
    assert consumer.get() == b"group 0"
    assert consumer.waiting() == [b"group 1", b"group 2"]  # left in place
    assert consumer.length() == 2
    producer.put(b"group 3")
    assert [consumer.get() for _ in range(3)] == [b"group 1", b"group 2", b"group 3"]
    assert consumer.length() == 0 and consumer.waiting() == []
    assert not store.check(["async/q/0", "async/q/3"])  # taken groups leave the store


def test_queue_wait_names_the_timeout():
    consumer = StoreQueue(dist.HashStore(), timeout_s=0.2)
    with pytest.raises(RuntimeError, match=r"trainer.collective_timeout_s=0 s \(waiting for group #0\)"):
        consumer.get()


def test_control_messages():
    control = Control(dist.HashStore(), timeout_s=0.2)
    assert control.read("weights") is None
    control.post("weights", 3)
    control.post("snap/result/1", {"sampler": {"position": 2}, "queued": []})
    assert control.read("weights") == 3
    assert control.wait("snap/result/1", "a snapshot") == {"sampler": {"position": 2}, "queued": []}
    with pytest.raises(RuntimeError, match="for the validation of step 4"):
        control.wait("val/result/4", "the validation of step 4")


def test_bridge_message_keeps_each_tensors_dtype():
    """A push of a Gated DeltaNet hybrid carries A_log in fp32 among bf16 tensors
    (``weight_transfer/transport.engine_dtype``): each comes back bit-exact in its own dtype, also an fp32 tensor
    after an odd number of bf16 values (an unaligned offset)."""
    g = torch.Generator().manual_seed(0)
    weights = [
        ("model.layers.0.linear_attn.in_proj_ba.weight", torch.randn(3, 5, generator=g).to(torch.bfloat16)),
        ("model.layers.0.linear_attn.A_log", torch.randn(4, generator=g)),
        ("model.layers.0.linear_attn.dt_bias", torch.randn(4, generator=g).to(torch.bfloat16)),
    ]
    header, flat = pack_weights(weights, torch.device("cpu"))
    assert flat.dtype == torch.uint8 and flat.numel() == packed_bytes(header) == 15 * 2 + 4 * 4 + 4 * 2
    back = unpack_weights(header, flat.clone())
    assert [n for n, _ in back] == [n for n, _ in weights]
    for (_, sent), (_, got) in zip(weights, back):
        assert got.dtype == sent.dtype and got.shape == sent.shape and torch.equal(got, sent)
