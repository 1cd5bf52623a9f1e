"""The reward model's pieces that need no process group: the position HF scores (against a real HF classifier), the
converter's output for a classifier, the reward term and its metrics, the row layout, and the refusals. Scores of
the whole model against HF at TP 1 and 2: ``tests/models/test_reward_model.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_dapo.config.schema import RewardModelConfig
from megatron_dapo.models.families import model_arch_from_hf
from megatron_dapo.reward.scoring import RewardResult
from megatron_dapo.rm.reward_model import reward_model_arch
from megatron_dapo.rm.score_head import reward_head, score_positions
from megatron_dapo.rm.scorer import RewardModelScorer, add_reward_model_scores
from megatron_dapo.testing.tiny_models import save_tiny_hf_checkpoint, tiny_hf_config
from megatron_dapo.weights.checkpoint_errors import CheckpointError
from megatron_dapo.weights.convert import convert_hf_to_mcore
from megatron_dapo.weights.dist_reader import DistCheckpointReader
from megatron_dapo.weights.safetensors_io import SafetensorsDir

PAD = 0


def _classifier(family: str = "qwen3", labels: int = 1, seed: int = 0):
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_hf_config(family, num_labels=labels, pad_token_id=PAD, num_layers=2)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model


@torch.no_grad()
def test_score_positions_are_where_hf_reads_its_scores():
    """HF's pooled logits of a right-padded batch (rows ending in the pad id among them) are its per-position
    scores at ``score_positions``."""
    model = _classifier()
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([7, 1, 12, 5, 9, 3])
    ids = torch.full((len(lengths), 12), PAD, dtype=torch.long)
    for i, n in enumerate(lengths.tolist()):
        ids[i, :n] = torch.randint(1, 100, (n,), generator=g)
    ids[3, 4] = PAD  # a real token equal to the pad id at the end of row 3: HF scores the one before it
    ids[4, 2] = PAD  # ... and inside row 4: HF ignores it there
    mask = (torch.arange(12)[None, :] < lengths[:, None]).long()
    pooled = model(input_ids=ids, attention_mask=mask).logits[:, 0]
    per_position = model.score(model.model(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0]
    where = score_positions(ids, lengths, PAD)
    assert where.tolist() == [6, 0, 11, 3, 8, 2]
    torch.testing.assert_close(per_position[torch.arange(len(lengths)), where], pooled, rtol=0, atol=1e-6)
    assert score_positions(ids, lengths, None).tolist() == (lengths - 1).tolist()


def test_converter_writes_the_score_head_and_no_lm_head(tmp_path):
    model = _classifier("llama", seed=2)
    model.save_pretrained(tmp_path / "hf", safe_serialization=True)
    convert_hf_to_mcore(tmp_path / "hf", tmp_path / "mcore")
    reader = DistCheckpointReader(tmp_path / "mcore" / "release")
    assert reader.tensors["output_layer.weight"] == (torch.float32, (1, 64))
    (head,) = reader.read([("output_layer.weight", None)])
    torch.testing.assert_close(head, model.score.weight.detach(), rtol=0, atol=0)
    with SafetensorsDir(tmp_path / "hf") as st:
        assert "lm_head.weight" not in st.keys() and "score.weight" in st.keys()
    # The decoder is the family's: its final norm is there, the embedding padded to 128 rows.
    assert reader.tensors["embedding.word_embeddings.weight"][1] == (128, 64)
    arch, spec = reward_model_arch(tmp_path / "mcore")
    assert (arch.family.name, spec.shape, spec.pad_token_id) == ("llama", (1, 64), PAD)


def test_causal_lm_and_multi_label_heads_are_refused(tmp_path):
    save_tiny_hf_checkpoint(tmp_path / "lm", "qwen2", num_layers=1)
    with pytest.raises(CheckpointError, match=r"architectures=\['Qwen2ForCausalLM'\] is not a \*ForSequence"):
        reward_model_arch(tmp_path / "lm")
    two = _classifier(labels=2)
    two.save_pretrained(tmp_path / "two", safe_serialization=True)
    arch, head = reward_model_arch(tmp_path / "two")
    assert head.shape == (2, 64)
    with pytest.raises(ValueError, match=r"num_labels=2; a reward model has one"):
        RewardModelScorer(None, head, RewardModelConfig(load_dir=str(tmp_path / "two")), arch.vocab_size)


def test_reward_term_and_metrics():
    scores = torch.tensor([1.5, -2.0, 0.25])
    lengths = torch.tensor([3, 0, 4])
    token_level = torch.zeros(3, 4)
    token_level[0, 2], token_level[2, 3] = 1.0, -1.0  # the rule-based rewards on the last tokens (row 1: empty)
    token_level[1, 3] = 0.5
    result = RewardResult(token_level, torch.tensor([1.0, 0.5, -1.0]), {"score": [1.0, 0.5, -1.0]}, {}, lengths)
    add_reward_model_scores(result, scores, weight=0.5)
    assert result.scores.tolist() == [1.75, -0.5, -0.875]
    assert result.token_level_scores[[0, 1, 2], [2, 3, 3]].tolist() == [1.75, -0.5, -0.875]
    assert result.token_level_scores.sum().item() == pytest.approx(1.75 - 0.5 - 0.875)
    assert result.extra["rm_score"] == [1.5, -2.0, 0.25]
    assert result.metrics == {
        "reward/rm_score/mean": pytest.approx(-0.25 / 3),
        "reward/rm_score/max": 1.5,
        "reward/rm_score/min": -2.0,
    }
    with pytest.raises(ValueError, match=r"shape \(2,\), the batch's rewards \(3,\)"):
        add_reward_model_scores(result, scores[:2], 1.0)


def test_rows_are_prompt_then_response_real_tokens_cut_to_max_length():
    config = tiny_hf_config("qwen2", num_labels=1).to_dict()
    arch = model_arch_from_hf({**config, "architectures": ["Qwen2ForSequenceClassification"]})
    head = reward_head(arch)
    scorer = RewardModelScorer(None, head, RewardModelConfig(load_dir="rm", max_length=5), arch.vocab_size)
    prompts = torch.tensor([[0, 0, 11, 12], [21, 22, 23, 24]])  # left-padded
    prompt_mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    responses = torch.tensor([[31, 32, 0], [41, 0, 0]])  # right-padded
    response_mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rows = scorer.sequences(prompts, prompt_mask, responses, response_mask)
    assert [r.tolist() for r in rows] == [[11, 12, 31, 32], [21, 22, 23, 24, 41]]
    rows = RewardModelScorer(None, head, RewardModelConfig(load_dir="rm", max_length=3), 100).sequences(
        prompts, prompt_mask, responses, response_mask
    )
    assert [r.tolist() for r in rows] == [[12, 31, 32], [23, 24, 41]]


def test_config_rules_name_the_reward_model_fields():
    from megatron_dapo.config import load_config
    from megatron_dapo.config.rules import config_problems

    assert not [p for p in config_problems(load_config(None, [])) if "reward_model" in p]
    cfg = load_config(
        None,
        [
            "reward.reward_model.load_dir=/rm",
            "reward.reward_model.weight=.nan",
            "reward.reward_model.max_length=0",
            "parallel.context_parallel_size=2",
        ],
    )
    found = [p for p in config_problems(cfg) if "reward_model" in p]
    assert found == [
        "reward.reward_model.weight=nan: expected a finite number",
        "reward.reward_model.max_length=0: expected an integer >= 1",
        "parallel.context_parallel_size=2 with reward.reward_model.load_dir='/rm': the reward model runs on one"
        " pipeline stage without context parallelism at the actor's tensor-parallel size; set"
        " parallel.context_parallel_size=1 or unset reward.reward_model.load_dir",
    ]


def test_memory_model_holds_the_reward_model_weights_where_it_scores(tmp_path):
    """Tiny qwen2 classifier at TP 2, per rank: the embedding 256 x 64 / 2 (vocabulary 100 padded to 128 x TP), 2
    layers of (qkv 128 x 64 + bias 128 + proj 64 x 64 + MLP 3 x 96 x 64) / 2 + norms 2 x 64, the final norm 64, the
    head 64: 39424 parameters, in bf16 (tests/models/test_reward_model.py checks the count on built models). On CUDA
    the hand-off offloads frozen models: the weights are on the device while it scores (generation), in host memory
    in the other phases."""
    from megatron_dapo.config import load_config
    from megatron_dapo.config.memory import STEP_PHASES, memory_model
    from megatron_dapo.config.plan import resolve
    from megatron_dapo.platform import make_platform
    from tests.helpers.hf_configs import SMALL_QWEN2

    rm = _classifier("qwen2", seed=4)
    rm.save_pretrained(tmp_path / "rm", safe_serialization=True)
    base = [
        "model.hf_config_dir=/not/read",
        "model.params_dtype=bf16",
        "model.make_vocab_size_divisible_by=128",
        "parallel.platform=cuda",
        "parallel.tensor_model_parallel_size=2",
        "rollout.tensor_model_parallel_size=2",
        "reward.custom_function.path=null",
    ]
    arch = model_arch_from_hf(SMALL_QWEN2)
    models = {}
    for name, extra in (("without", []), ("with", [f"reward.reward_model.load_dir={tmp_path / 'rm'}"])):
        cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "tiny_cpu.yaml", base + extra)
        plan = resolve(cfg, arch, 4, make_platform("cuda"), probe_imports=False)
        models[name] = {ph.name: ph for ph in memory_model(plan, arch, cfg, None).phases}
    per_rank = 256 * 64 // 2 + 2 * ((128 * 64 + 128 + 64 * 64 + 3 * 96 * 64) // 2 + 2 * 64) + 64 + 64
    assert per_rank == 39424
    for name, phase in models["with"].items():
        added = phase.device_total - models["without"][name].device_total
        expected = per_rank * 2 if name == "gen" else 0
        assert added == expected and phase.device.get("reward model", 0) == expected, (name, added)
        on_host = per_rank * 2 if (name in STEP_PHASES or name == "save") and name != "gen" else 0
        assert phase.host.get("reward model", 0) == on_host, (name, phase.host)
