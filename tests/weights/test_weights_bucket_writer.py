"""The training save's writer parts (``weights.dist_writer``, ``weights.integrity``) without a model: exact-storage
aliases of views (what ``torch.save`` then writes), host staging (a snapshot for background saves, aliases in place
otherwise), and ``HashingWriter`` writing everything in hashed pieces through short writes, with the disk started
every ``writeback_every`` bytes. The writer threads, their bounds and background saves run with a real checkpoint
in ``tests/training/test_checkpoint_integrity.py``."""

from __future__ import annotations

import io

import torch
import xxhash

from megatron_dapo.weights import integrity
from megatron_dapo.weights.dist_writer import HostStaging, exact_storage
from megatron_dapo.weights.integrity import HashingWriter


def saved(t: torch.Tensor) -> bytes:
    """What ``torch.save`` writes for ``t``."""
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def test_exact_storage_writes_a_views_bytes_only() -> None:
    base = torch.arange(2000, dtype=torch.float32)
    view = base[400:1000].view(20, 30)
    alias = exact_storage(view)
    assert alias.data_ptr() == view.data_ptr() and alias.untyped_storage().nbytes() == view.numel() * 4
    assert torch.equal(alias, view) and exact_storage(base) is base
    # torch.save writes a tensor's whole storage: the view alone would carry all of ``base``.
    assert len(saved(alias)) < len(saved(view)) - 5000
    assert torch.equal(torch.load(io.BytesIO(saved(alias))), view)
    odd = base.view(40, 50)[:, :10]  # not contiguous: returned as it is (megatron-core clones it)
    assert exact_storage(odd) is odd


def test_host_staging_snapshots_or_aliases() -> None:
    made: list[int] = []

    def alloc(nbytes: int) -> torch.Tensor:
        made.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    staging = HostStaging(alloc, lambda buffer: None, lambda: None)
    base = torch.arange(100, dtype=torch.float32)
    tensors = {
        "view": base[10:40],
        "bf16_t": torch.arange(6, dtype=torch.bfloat16).view(2, 3).t(),
        "step": torch.tensor(3.0),
    }
    buckets = [("file", "key", ([("bytes-item", io.BytesIO(b"x"))], list(tensors.items())))]
    staged = staging.stage(buckets, host_too=True)
    got = dict(staged[0][2][1])
    assert staged[0][2][0] == buckets[0][2][0]  # byte items pass through
    buffer = staging.buffer
    for name, t in tensors.items():
        assert torch.equal(got[name], t) and got[name].dtype == t.dtype, name
        assert got[name].untyped_storage().nbytes() == t.numel() * t.element_size(), name
        offset = got[name].data_ptr() - buffer.data_ptr()
        assert 0 <= offset < buffer.numel() and offset % HostStaging.ALIGN == 0, name
    base.add_(1)  # training goes on: the snapshot keeps the values of the moment it was taken
    assert torch.equal(got["view"], torch.arange(10, 40, dtype=torch.float32))
    # The buffer is kept from save to save; without ``host_too`` CPU tensors are aliased in place, not copied.
    assert staging.stage(buckets, host_too=True) and len(made) == 1
    in_place = dict(staging.stage(buckets, host_too=False)[0][2][1])
    assert in_place["view"].data_ptr() == tensors["view"].data_ptr()
    assert in_place["view"].untyped_storage().nbytes() == 30 * 4


class ShortWrites(io.RawIOBase):
    """A file that takes at most 300 bytes per ``write``."""

    def __init__(self) -> None:
        super().__init__()
        self.data = bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = min(len(b), 300)
        self.data += bytes(memoryview(b)[:n])
        return n

    def fileno(self) -> int:
        return -1


def test_hashing_writer_writes_everything_in_pieces(monkeypatch) -> None:
    kicked: list[tuple[int, int]] = []
    monkeypatch.setattr(integrity, "_PIECE", 1000)
    monkeypatch.setattr(integrity, "start_writeback", lambda fd, offset, length: kicked.append((offset, length)))
    raw = ShortWrites()
    writer = HashingWriter(raw, writeback_every=2000)
    data = bytes(range(256)) * 20
    assert writer.write(data) == len(data) and writer.write(b"") == 0
    assert bytes(raw.data) == data and writer.size == len(data)
    assert writer.digest == xxhash.xxh3_64(data).hexdigest()
    assert kicked == [(0, 2000), (2000, 2000)]  # the last 1120 bytes are left to the file's fsync


def test_bucket_writer_waits_with_a_bound(monkeypatch) -> None:
    """Results come back by bucket (any number of threads); the first failure or the first unfinished file is named."""
    import threading

    from megatron_dapo.weights import dist_writer
    from megatron_dapo.weights.dist_writer import BucketWriter
    from megatron_dapo.weights.integrity import FileRecord

    release = threading.Event()

    def fake_write(bucket):
        name = bucket[0]
        if name == "bad":
            raise OSError(28, "No space left on device")
        if name == "slow":
            release.wait(10)
        return [f"result of {name}"], FileRecord(name, 1, "0" * 16)

    monkeypatch.setattr(dist_writer, "write_bucket", fake_write)
    buckets = [(name, "key", ([], [])) for name in ("a", "b", "c")]
    for threads in (1, 2, None):
        done, records, error = BucketWriter(buckets, "step 1", threads=threads).start().wait(5)
        assert error is None and done == {0: ["result of a"], 1: ["result of b"], 2: ["result of c"]}
        assert [r.path for r in records] == ["a", "b", "c"]
    _, _, error = BucketWriter([("a", "k", ([], [])), ("bad", "k", ([], []))], "step 2").start().wait(5)
    assert (
        error == "checkpoint writer thread (writing bad) for step 2 failed: OSError: [Errno 28] No space left on device"
    )
    _, _, error = BucketWriter([("a", "k", ([], [])), ("slow", "k", ([], []))], "step 3").start().wait(0.2)
    release.set()
    assert error == "checkpoint writer thread (writing slow) for step 3 did not finish within timeout_s=0.2"
