"""The megatron-core reward model (``megatron_dapo/rm/``) scores as HF's ``*ForSequenceClassification`` does, fp32.

``reward_model_worker.py`` runs, in one 2-process torchrun, TP 1 (DP 2: the scorer deals rows over the ranks and
gathers) with the sdpa attention backend and TP 2 with megatron-core's own attention and an explicit causal mask, for
qwen2 (tied embeddings), qwen3 (qk-norm) and llama (llama3 rope), loading both the HF directory and its
``convert_hf_to_mcore`` conversion. Sequences of different lengths, one ending in the pad id (HF scores the token
before it); HF's reference is each sequence alone, and HF itself must give the same in right- and left-padded
batches.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import run_torchrun
from tests.models.reward_model_worker import BASE_REWARD, FAMILIES, RM_WEIGHT, SEQUENCES

WORKER = Path(__file__).with_name("reward_model_worker.py")
PORT = 29933  # this file's
SCORE_ATOL = 1e-4
LAYOUTS = {"tp1": (1, 2), "tp2-local": (2, 1)}  # layout -> (TP, DP) on 2 processes
HIDDEN, VOCAB = 64, 100


def _counted(family: str, tp: int) -> int:
    """``config/memory.py``'s reward-model term, in parameters (``rm/memory_term.reward_model_rank_params``)."""
    from megatron_dapo.models.families import model_arch_from_hf
    from megatron_dapo.rm.memory_term import reward_model_rank_params
    from megatron_dapo.testing.tiny_models import tiny_hf_config

    config = tiny_hf_config(family, tie_word_embeddings=family == "qwen2", num_labels=1).to_dict()
    arch = model_arch_from_hf({**config, "architectures": ["Qwen2ForSequenceClassification"]})
    return reward_model_rank_params(arch, tp, 128)


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("reward_model")
    run_torchrun(WORKER, 2, ["--layouts", ",".join(LAYOUTS), "--out", out], port=PORT, timeout=600)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scores_equal_hf_sequence_classification(reports, layout):
    tp, dp = LAYOUTS[layout]
    worst = 0.0
    for rank, report in enumerate(reports):
        entry = report["layouts"][layout]
        assert (entry["tp"], entry["dp"]) == (tp, dp), f"rank {rank}: built {entry}"
        for family in FAMILIES:
            f = entry["families"][family]
            ref = f["hf"]["alone"]
            assert len(ref) == len(SEQUENCES) and len(set(ref)) == len(ref), f"{family}: degenerate HF scores {ref}"
            assert max(abs(x) for x in ref) > 1.0, f"{family}: HF scores too small to compare at {SCORE_ATOL}: {ref}"
            for padded in ("right", "left"):  # the reference itself is padding-invariant
                assert max(abs(a - b) for a, b in zip(f["hf"][padded], ref)) <= SCORE_ATOL, (family, padded)
            for source, got in f["ours"].items():
                diff = max(abs(a - b) for a, b in zip(got, ref))
                worst = max(worst, diff)
                assert len(got) == len(ref) and diff <= SCORE_ATOL, (
                    f"rank {rank} {layout} {family} from {source}: scores {got}, HF {ref}, max |diff| {diff:.3g}"
                )
            # Frozen, a [1, hidden] head and no vocabulary-sized LM head: tied or not, the parameters on a rank are
            # HF's plus the vocabulary padding rows (TP 1), and what the memory model counts.
            assert f["trainable"] == 0 and f["head_shape"] == [1, HIDDEN], (family, f["head_shape"])
            assert f["params"] == _counted(family, tp), (family, tp, f["params"])
            if tp == 1:
                assert f["params"] == f["hf_params"] + (128 - VOCAB) * HIDDEN, (family, f["params"], f["hf_params"])
    print(f"{layout}: max |score - HF| = {worst:.3g}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_scorer_built_from_its_section_adds_the_weighted_score(reports, layout):
    """``RewardModelScorer.build`` (section + resolved plan) and the reward stage's hook ``score_rollout`` on a
    ``RolloutBatch`` (prompt / response splits of the sequences, one response empty): each reward gains
    ``RM_WEIGHT`` x HF's score on its sequence and on its last response token; the metrics summarise the scores."""
    for rank, report in enumerate(reports):
        for family in FAMILIES:
            f = report["layouts"][layout]["families"][family]
            c, ref = f["component"], f["hf"]["alone"]
            assert c["explicit_causal_mask"] == layout.endswith("-local"), c["explicit_causal_mask"]
            diff = max(abs(a - b) for a, b in zip(c["rm_score"], ref))
            assert len(c["rm_score"]) == len(ref) and diff <= SCORE_ATOL, (rank, family, c["rm_score"], ref)
            expected = [BASE_REWARD + RM_WEIGHT * x for x in c["rm_score"]]
            assert c["scores"] == pytest.approx(expected, abs=1e-6), (rank, family)
            assert c["token_level_row_sums"] == pytest.approx(expected, abs=1e-6), (rank, family)
            # Through the hand-off (offloading frozen models): off the device after the build and after scoring,
            # back (every byte) for the scoring, whose scores are HF's above.
            assert c["handoff_reference_planned"] and c["rm_bytes"] > 0
            assert c["held_after_build"] == c["held_after_scoring"] == 0
            assert c["restored_bytes"] == c["rm_bytes"] and c["released_bytes"] == 2 * c["rm_bytes"]
            assert c["metrics"] == {
                "reward/rm_score/mean": pytest.approx(sum(c["rm_score"]) / len(ref), abs=1e-5),
                "reward/rm_score/max": pytest.approx(max(c["rm_score"]), abs=1e-6),
                "reward/rm_score/min": pytest.approx(min(c["rm_score"]), abs=1e-6),
            }
