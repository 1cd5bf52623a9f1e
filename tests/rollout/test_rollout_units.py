"""Single-process tests of the rollout pieces that need no engine: padding, sampling specs, seeds, sharding, metrics,
and the configuration errors raised before vLLM is started."""

from __future__ import annotations

import pytest
import torch

from megatron_dapo.config import ConfigError, load_config
from megatron_dapo.config.plan import rollout_plan
from megatron_dapo.platform import make_platform
from megatron_dapo.rollout.engine import RolloutEngine, request_seed, shard_range, vllm_llm_kwargs
from megatron_dapo.rollout.sync import logprob_diff_metrics
from megatron_dapo.rollout.types import SamplingSpec, build_rollout_batch, pack_rows, unpack_rows
from tests.helpers.engines import engine_sections


def small_batch():
    return build_rollout_batch(
        prompts=[[5, 6, 7], [8]],
        responses=[[1, 2], [3], [4, 5, 6]],
        log_probs=[[-0.5, -1.5], [-2.0], [-0.1, -0.2, -0.3]],
        truncated=[False, False, True],
        prompt_index=[0, 0, 1],
        pad_token_id=0,
    )


def test_build_rollout_batch_padding_and_positions():
    b = small_batch()
    assert b.prompts.tolist() == [[5, 6, 7], [5, 6, 7], [0, 0, 8]]  # left-padded
    assert b.prompt_mask.tolist() == [[1, 1, 1], [1, 1, 1], [0, 0, 1]]
    assert b.responses.tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]  # right-padded to the longest response
    assert b.response_mask.tolist() == [[1, 1, 0], [1, 0, 0], [1, 1, 1]]
    expected_lp = torch.tensor([[-0.5, -1.5, 0.0], [-2.0, 0.0, 0.0], [-0.1, -0.2, -0.3]])
    assert torch.equal(b.rollout_log_probs, expected_lp)
    assert b.response_lengths.tolist() == [2, 1, 3]
    assert b.truncated.tolist() == [False, False, True]
    assert b.prompt_index.tolist() == [0, 0, 1]
    assert b.input_ids.tolist() == [[5, 6, 7, 1, 2, 0], [5, 6, 7, 3, 0, 0], [0, 0, 8, 4, 5, 6]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1]]
    # First real token is position 0 (as in vLLM); left padding sits at 0, right padding repeats the last position.
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 4, 4], [0, 1, 2, 3, 3, 3], [0, 0, 0, 1, 2, 3]]
    assert len(b) == 3


def test_build_rollout_batch_fixed_length_and_errors():
    b = build_rollout_batch([[9, 9]], [[1]], [[-1.0]], [False], [0], pad_token_id=3, response_length=4)
    assert b.responses.tolist() == [[1, 3, 3, 3]] and b.input_ids.shape == (1, 6)
    with pytest.raises(ValueError, match="shorter than the longest response"):
        build_rollout_batch([[1]], [[1, 2, 3]], [[0.0] * 3], [False], [0], pad_token_id=0, response_length=2)
    with pytest.raises(ValueError, match="row 0: 2 response tokens but 1 log-probs"):
        build_rollout_batch([[1]], [[1, 2]], [[0.0]], [False], [0], pad_token_id=0)
    with pytest.raises(ValueError, match="same length"):
        build_rollout_batch([[1]], [[1]], [[0.0]], [False, True], [0], pad_token_id=0)
    # All responses empty: T is 1 so tensors keep a time dimension.
    empty = build_rollout_batch([[4]], [[]], [[]], [False], [0], pad_token_id=0)
    assert empty.responses.shape == (1, 1) and empty.response_mask.sum() == 0
    # A referenced empty prompt is named; an unreferenced one is not looked at. No rows: empty tensors, T = P = 1.
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        build_rollout_batch([[1], []], [[1], [2]], [[0.0], [0.0]], [False, False], [0, 1], pad_token_id=0)
    assert build_rollout_batch([[1], []], [[2]], [[0.0]], [False], [0], pad_token_id=0).prompts.tolist() == [[1]]
    none = build_rollout_batch([[1]], [], [], [], [], pad_token_id=0)
    assert none.responses.shape == (0, 1) and none.prompts.shape == (0, 1) and none.input_ids.shape == (0, 2)


def test_sampling_specs_from_config():
    cfg = load_config(
        None,
        [
            "rollout.n=4",
            "rollout.temperature=0.9",
            "rollout.top_p=0.95",
            "rollout.top_k=20",
            "data.max_response_length=33",
            "rollout.val_kwargs.n=2",
        ],
    )
    train = SamplingSpec.for_training(cfg.rollout, cfg.data.max_response_length, [7, 8])
    assert (train.n, train.temperature, train.top_p, train.top_k, train.max_tokens, train.stop_token_ids) == (
        4,
        0.9,
        0.95,
        20,
        33,
        (7, 8),
    )
    assert not train.greedy
    greedy = SamplingSpec.for_validation(cfg.rollout, cfg.data.max_response_length, [7])
    assert greedy.greedy and (greedy.n, greedy.top_p, greedy.top_k, greedy.max_tokens) == (2, 1.0, -1, 33)
    cfg2 = load_config(
        None,
        ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0.6", "rollout.val_kwargs.top_p=0.7"],
    )
    sampled = SamplingSpec.for_validation(cfg2.rollout, cfg2.data.max_response_length)
    assert (sampled.temperature, sampled.top_p) == (0.6, 0.7) and not sampled.greedy
    for bad, match in [
        (dict(n=0), "n=0"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(temperature=-1.0), "temperature"),
        (dict(max_tokens=0), "max_tokens"),
    ]:
        kwargs = dict(n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=4) | bad
        with pytest.raises(ValueError, match=match):
            SamplingSpec(**kwargs)


def test_request_seeds_deterministic_distinct_and_63_bit():
    seeds = {(o, p, s): request_seed(7, o, p, s) for o in range(4) for p in range(50) for s in range(8)}
    assert len(set(seeds.values())) == len(seeds)  # no two requests share a random stream
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert request_seed(7, 1, 2, 3) == seeds[(1, 2, 3)]
    assert request_seed(8, 1, 2, 3) != seeds[(1, 2, 3)]  # the config seed matters


@pytest.mark.parametrize("num_items", [0, 1, 5, 7, 16])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_shard_range_contiguous_balanced(num_items, num_shards):
    ranges = [shard_range(num_items, num_shards, s) for s in range(num_shards)]
    assert [i for r in ranges for i in r] == list(range(num_items))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_logprob_diff_metrics_hand_computed():
    train = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, 0.0]])
    rollout = torch.tensor([[-1.1, -2.0, -2.5], [-0.25, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    m = logprob_diff_metrics(train, rollout, mask)
    assert m["rollout/logprob_diff_max"] == pytest.approx(0.5)
    assert m["rollout/logprob_diff_mean"] == pytest.approx((0.1 + 0.0 + 0.5 + 0.25) / 4)
    assert logprob_diff_metrics(train, rollout, torch.zeros_like(mask)) == {
        "rollout/logprob_diff_mean": 0.0,
        "rollout/logprob_diff_max": 0.0,
    }
    with pytest.raises(ValueError, match="shapes differ"):
        logprob_diff_metrics(train, rollout[:, :2], mask)


def validate_rollout_layout(cfg, world_size: int, max_position_embeddings: int) -> tuple[int, int]:
    sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
    plan = rollout_plan(*sections, max_position_embeddings, world_size, make_platform("cpu"))
    return plan.max_model_len, plan.dp_size


def test_validate_rollout_layout():
    cfg = load_config(
        None, ["rollout.tensor_model_parallel_size=2", "data.max_prompt_length=20", "data.max_response_length=12"]
    )
    assert validate_rollout_layout(cfg, world_size=4, max_position_embeddings=32) == (32, 2)
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size=2 must be >= 1 and divide the world size 3"):
        validate_rollout_layout(cfg, world_size=3, max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"20 \+ 12 = 32 exceeds the model's max_position_embeddings=31"):
        validate_rollout_layout(cfg, world_size=2, max_position_embeddings=31)
    small = load_config(
        None, ["rollout.max_num_batched_tokens=16", "data.max_prompt_length=20", "data.max_response_length=12"]
    )
    with pytest.raises(ConfigError, match="rollout.max_num_batched_tokens=16 must be >="):
        validate_rollout_layout(small, world_size=1, max_position_embeddings=64)


def test_engine_rejects_bad_configs_before_starting_vllm(tiny_checkpoints, monkeypatch):
    """The engine's own checks, with the world size torchrun would give; vLLM is never started (and the platform is
    not set up, so no CPU shims are installed in the pytest process)."""
    from megatron_dapo.platform import make_platform

    ckpt = tiny_checkpoints["qwen2"]  # max_position_embeddings = 64
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    cfg = load_config(None, ["rollout.tensor_model_parallel_size=3"])
    with pytest.raises(ConfigError) as err:
        RolloutEngine(*engine_sections(cfg), str(ckpt), make_platform("cpu"), pad_token_id=0)
    assert "rollout.tensor_model_parallel_size=3" in str(err.value) and "world size 4" in str(err.value)

    cfg = load_config(None, ["data.max_prompt_length=40", "data.max_response_length=30"])
    with pytest.raises(ConfigError) as err:
        RolloutEngine(*engine_sections(cfg), str(ckpt), make_platform("cpu"), pad_token_id=0)
    msg = str(err.value)
    assert "data.max_prompt_length" in msg and "data.max_response_length" in msg
    assert "max_position_embeddings=64" in msg and "70" in msg


def test_rows_carry_routing_through_the_gather_packing():
    """Rows travel between replicas packed into tensors; a row's routing (routing replay) must come back attached to
    the same row, and rows without one (replay off, or the tests' 5-item rows) stay without."""
    r0 = torch.arange(5 * 2 * 3, dtype=torch.int16).reshape(5, 2, 3)
    r1 = -torch.arange(3 * 2 * 3, dtype=torch.int16).reshape(3, 2, 3)
    rows = [(0, 1, [4, 5, 6], [-0.5, -1.0, -2.0], False, r0), (2, 0, [7], [-0.25], True, r1)]
    back = unpack_rows(pack_rows(rows))
    assert [r[:5] for r in back] == [r[:5] for r in rows]
    assert torch.equal(back[0][5], r0) and torch.equal(back[1][5], r1)
    plain = [(1, 0, [3, 2], [-1.0, -3.0], False)]
    (row,) = unpack_rows(pack_rows(plain))
    assert row[:5] == plain[0] and row[5] is None


def test_vllm_llm_kwargs_from_the_rollout_plan(tiny_checkpoints):
    """The engine's ``vllm.LLM`` arguments come from the resolved plan, the config and the platform (no vLLM)."""
    ckpt = str(tiny_checkpoints["qwen2"])
    cfg = load_config(
        None,
        ["rollout.kv_cache_memory_mb=32", "rollout.seed=5", "data.max_prompt_length=20", "data.max_response_length=12"],
    )
    cpu = make_platform("cpu")
    sections = (cfg.rollout, cfg.data, cfg.model, cfg.actor, cfg.trainer)
    plan = rollout_plan(*sections, 64, 2, cpu)
    kwargs = vllm_llm_kwargs(cfg.rollout, cfg.actor, cfg.trainer.mode, ckpt, plan, cpu)
    assert kwargs["model"] == ckpt and kwargs["load_format"] == "dummy" and kwargs["skip_tokenizer_init"]
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    assert kwargs["tensor_parallel_size"] == plan.tp_size and kwargs["max_model_len"] == plan.max_model_len
    assert kwargs["max_num_batched_tokens"] == plan.max_num_batched_tokens and kwargs["seed"] == 5
    # CPU: per-request seeds, so no chunked prefill; the KV cache sized by rollout.kv_cache_memory_mb; no sleep mode.
    assert kwargs["enable_chunked_prefill"] is False and kwargs["kv_cache_memory_bytes"] == 32 * 2**20
    assert kwargs["enable_sleep_mode"] is False and "gpu_memory_utilization" not in kwargs
    cuda = make_platform("cuda")
    on_gpu = vllm_llm_kwargs(cfg.rollout, cfg.actor, cfg.trainer.mode, ckpt, rollout_plan(*sections, 64, 2, cuda), cuda)
    assert on_gpu["gpu_memory_utilization"] == cfg.rollout.gpu_memory_utilization
    assert on_gpu["enable_chunked_prefill"] is True and "kv_cache_memory_bytes" not in on_gpu
