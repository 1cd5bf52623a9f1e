"""The CPU platform's accommodations of vLLM (``platform/cpu_shims.py``)."""

from __future__ import annotations


def test_vllm_cpu_shared_memory_is_named_per_job(monkeypatch):
    """vllm-cpu names its TP segments from an empty identifier under the external launcher; the shim puts the job's
    port and attempt in front, without the slashes an ``env://`` init leaves (a slash inside a name is EINVAL)."""
    from types import SimpleNamespace

    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    from megatron_dapo.platform.cpu_shims import vllm_cpu_job_shm_names

    vllm_cpu_job_shm_names()
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")  # what vLLM's CPU worker derives from env://
    group = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    for port, attempt in (("29776", "0"), ("29777", "0"), ("29776", "1")):
        monkeypatch.setenv("MASTER_PORT", port)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", attempt)
        assert _CPUSHMDistributed.make_group_name(group) == f"mdapo{port}.{attempt}-tp:0-[0-1]-cpushm"
