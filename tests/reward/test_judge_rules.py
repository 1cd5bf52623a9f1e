"""The judge's pure parts (docs/judge.md): the score parsers, the template and what the judge reads, the config
gate's lines for ``reward.judge``, and its terms in the memory model (``judge/judge_memory.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_dapo.config import config_problems, load_config
from megatron_dapo.judge.judge_prompt import fill, template_fields
from megatron_dapo.judge.parsers import build_parser, clamped, last_number

ROOT = Path(__file__).resolve().parents[2]


def test_parsers_read_the_score_or_none():
    assert last_number("Score: 7 out of 10") == 10.0  # the last number: ask for the number only
    assert last_number("I rate it 8.5.") == 8.5
    assert last_number("-2") == -2.0 and last_number("1e2") == 100.0
    assert last_number("no score here") is None and last_number("") is None
    regex = build_parser("regex", r"SCORE=(\d+)", {})
    assert regex("x SCORE=4 y SCORE=9") == 4.0 and regex("SCORE=") is None
    assert build_parser("regex", r"\d+", {})("a 12 b") == 12.0  # no group: the whole match
    assert build_parser("regex", r"(yes|no)", {})("yes") is None  # a group that is no number: no score
    choice = build_parser("choice", None, {"GOOD": 1.0, "BAD": 0.0, "VERY GOOD": 2.0})
    assert choice("it is BAD, not GOOD") == 0.0  # the earliest label
    assert choice("VERY GOOD indeed") == 2.0  # the longer label where two start at the same place
    assert choice("GOODBAD") is None and choice("nothing") is None  # whole words only
    assert clamped(12.0, [0, 10]) == 10.0 and clamped(-1.0, [0, 10]) == 0.0 and clamped(None, [0, 1]) is None
    assert clamped(3.0, None) == 3.0


def test_template_fields_and_what_the_judge_reads():
    assert template_fields("Q {prompt} A {response} {{literal}} T {ground_truth}") == [
        "prompt",
        "response",
        "ground_truth",
    ]
    item = {
        "prompt_messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        "raw_prompt": "<|im_start|>system...",
        "ground_truth": 4,
    }
    assert fill("{prompt}|{response}|{ground_truth}|{{x}}", item, "four") == "2+2?|four|4|{x}"
    assert fill("{prompt}", {"prompt_messages": "plain text prompt"}, "") == "plain text prompt"


def _judge_problems(*overrides: str) -> list[str]:
    cfg = load_config(None, ["reward.judge.model_path=/models/judge", *overrides])
    return [p for p in config_problems(cfg) if "judge" in p]


def test_the_gate_names_each_bad_judge_field():
    assert not [p for p in config_problems(load_config(None, [])) if "judge" in p]  # off by default
    assert _judge_problems() == []  # the defaults are valid
    (line,) = _judge_problems("reward.judge.prompt_template='Rate {prompt}'")
    assert "no {response} field" in line
    (line,) = _judge_problems("reward.judge.prompt_template='{response} {answer} {rubric}'")
    assert "unknown fields ['answer', 'rubric']" in line
    (line,) = _judge_problems("reward.judge.prompt_template='{response} {'")
    assert "reward.judge.prompt_template: malformed" in line
    (line,) = _judge_problems("reward.judge.parser=first_word")
    assert "reward.judge.parser='first_word': expected one of ['choice', 'last_number', 'regex']" == line
    (line,) = _judge_problems("reward.judge.parser=regex")
    assert line.startswith("reward.judge.pattern=None: parser=regex needs")
    (line,) = _judge_problems("reward.judge.parser=regex", "reward.judge.pattern='(unclosed'")
    assert "not a regular expression" in line
    (line,) = _judge_problems("reward.judge.parser=choice")
    assert line.startswith("reward.judge.choices={}: parser=choice needs")
    bad = _judge_problems(
        "reward.judge.score_range=[5, 1]",
        "reward.judge.top_p=0",
        "reward.judge.max_tokens=0",
        "reward.judge.dtype=float32",
        "reward.judge.gpu_memory_utilization=1.5",
    )
    for key in ("score_range", "top_p", "max_tokens", "dtype", "gpu_memory_utilization"):
        assert any(line.startswith(f"reward.judge.{key}=") for line in bad), (key, bad)
    (line,) = _judge_problems("trainer.mode=async", "placement.rollout_ranks=1")
    assert line.startswith("trainer.mode='async' with reward.judge.model_path='/models/judge'")


def test_memory_model_counts_the_judge_where_it_is_awake(tmp_path):
    """A tiny qwen2 judge (its parameter count from transformers) at rollout TP 2 in bf16: on CUDA (sleep mode) its
    weights and KV cache are on the device in generation only and its weights in host memory in the other step
    phases; on vLLM-CPU (no sleep) both stay on the device, start-up excepted (the judge is built after it)."""
    from megatron_dapo.config.memory import STEP_PHASES, memory_model
    from megatron_dapo.config.plan import resolve
    from megatron_dapo.judge.judge_memory import judge_lines, judge_terms
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.platform import make_platform
    from megatron_dapo.testing.tiny_models import make_tiny_hf_model
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer
    from tests.helpers.hf_configs import SMALL_QWEN2

    judge = make_tiny_hf_model("qwen2", seed=2, vocab_size=128, num_layers=2, hidden_size=64, intermediate_size=96)
    judge.save_pretrained(tmp_path / "judge", safe_serialization=True)
    build_tiny_tokenizer(tmp_path / "tok")
    weights = sum(p.numel() for p in judge.state_dict().values()) * 2 / 2
    arch = model_arch_from_hf(SMALL_QWEN2)
    base = [
        "model.hf_config_dir=/not/read",
        "model.params_dtype=bf16",
        "parallel.tensor_model_parallel_size=2",
        "rollout.tensor_model_parallel_size=2",
        "reward.custom_function.path=null",
        "reward.judge.kv_cache_memory_mb=3",
        "reward.judge.max_prompt_length=48",
        "reward.judge.max_tokens=16",
    ]
    for platform in ("cuda", "cpu"):
        phases = {}
        judged = [f"reward.judge.model_path={tmp_path / 'judge'}", f"reward.judge.tokenizer_path={tmp_path / 'tok'}"]
        for name, extra in (("without", []), ("with", judged)):
            cfg = load_config(ROOT / "configs" / "tiny_cpu.yaml", base + [f"parallel.platform={platform}", *extra])
            plan = resolve(cfg, arch, 4, make_platform(platform), probe_imports=False)
            phases[name] = {ph.name: ph for ph in memory_model(plan, arch, cfg, None).phases}
        sleeps = plan.rollout.sleeps
        assert sleeps == (platform == "cuda")
        for name, phase in phases["with"].items():
            awake = name != "startup" and (not sleeps or name == "gen")
            added = phase.device_total - phases["without"][name].device_total
            assert added == pytest.approx(weights + 3 * 2**20 if awake else 0), (platform, name)
            hosted = phase.host.get("judge weights", 0)
            assert hosted == (weights if sleeps and not awake and name != "startup" else 0), (platform, name)
        assert any(name in STEP_PHASES for name in phases["with"])
        # what `megatron-dapo check` prints for it
        lines = judge_lines(cfg.reward.judge, plan, judge_terms(cfg.reward.judge, plan, None))
        assert (
            f"a second vLLM engine at rollout TP 2 in each of the 2 replica(s); weights {weights / 2**20:.2f} MiB"
            in lines[0]
        )
        assert ("asleep except while it scores" if sleeps else "resident (no vLLM sleep mode here)") in lines[0]


def test_a_second_engines_start_up_messages_are_known_benign():
    """What vLLM logs when the judge's engine starts after the rollout engine (a 2-rank training run's rank log):
    kept off the console; a reworded message is not."""
    from megatron_dapo.log_filters import known_benign

    second_start = [
        ("vllm.platforms.interface", "Unknown vLLM environment variable detected: VLLM_DIST_IDENT"),
        (
            "vllm.engine.arg_utils",
            "The global random seed is set to 0. Since VLLM_ENABLE_V1_MULTIPROCESSING is set to False, this may"
            " affect the random state of the Python process that launched vLLM.",
        ),
        (
            "vllm.triton_utils.dispatcher",
            "Kernel vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel is already registered. Overwriting.",
        ),
    ]
    for logger, message in second_start:
        assert known_benign(logger, message) is not None, message
    assert known_benign("vllm.platforms.interface", "Unknown vLLM environment variable detected: VLLM_FOO") is None
    assert known_benign("vllm.triton_utils.dispatcher", "Kernel my_kernel is already registered. Overwriting.") is None


def test_the_judges_files_are_checked_with_the_run(tmp_path):
    """``config/plan.plan_problems`` reads the judge's config.json: its context against the input and answer
    lengths, its heads against the rollout's TP, and a tokenizer where the config says."""
    from megatron_dapo.config.schema import JudgeConfig
    from megatron_dapo.judge.judge_files import judge_file_problems
    from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint
    from megatron_dapo.testing.tokenizer import build_tiny_tokenizer

    judge = save_tiny_hf_checkpoint(
        tmp_path / "judge",
        "qwen2",
        vocab_size=128,
        num_layers=1,
        hidden_size=64,
        intermediate_size=64,
        num_heads=4,
        num_kv_heads=2,
        max_position_embeddings=64,
    )
    build_tiny_tokenizer(tmp_path / "tok")
    fits = JudgeConfig(model_path=str(judge), tokenizer_path=str(tmp_path / "tok"), max_prompt_length=48, max_tokens=16)
    assert judge_file_problems(fits, 2) == []
    assert judge_file_problems(JudgeConfig(), 2) == []  # off
    long, no_tok = JudgeConfig(**{**fits.__dict__, "max_tokens": 17}), JudgeConfig(model_path=str(judge))
    (line,) = judge_file_problems(long, 2)
    assert "reward.judge.max_prompt_length=48 + reward.judge.max_tokens=17 = 65: more than" in line
    assert "max_position_embeddings=64" in line
    assert judge_file_problems(fits, 4) == []  # 4 heads over 4 ranks; 2 KV heads, each on 2 ranks
    heads, kv = judge_file_problems(fits, 3)
    assert "num_attention_heads=4 is not split by rollout.tensor_model_parallel_size=3" in heads
    assert "num_key_value_heads=2 is neither split by nor a divisor of rollout.tensor_model_parallel_size=3" in kv
    (line,) = judge_file_problems(JudgeConfig(**{**no_tok.__dict__, "max_prompt_length": 8}), 1)
    assert line.startswith(f"reward.judge.model_path={str(judge)!r}: no tokenizer files")
    (line,) = judge_file_problems(JudgeConfig(model_path=str(tmp_path / "nothing")), 1)
    assert "no readable config.json" in line
