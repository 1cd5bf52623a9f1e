"""The async job's store channels (``rollout/remote.py``) on a real torch.distributed store (``HashStore``, the same
key-value API as the job's TCPStore): the queue keeps order and its length across producer and consumer objects, a
snapshot reads the waiting groups without taking them, a missing group or message fails with the setting to raise.
The bridge and the whole protocol run in the multi-process tests of ``tests/e2e/test_async_e2e.py``."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_dapo.rollout.remote import Control, StoreQueue


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
