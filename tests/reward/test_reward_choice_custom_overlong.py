"""Multiple-choice scorer, custom reward function loading/combination, overlong shaping."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

from megatron_dapo.reward import choice
from megatron_dapo.reward.custom import InvalidRewardError, combine, load_reward_function
from megatron_dapo.reward.overlong import overlong_penalty

# ----------------------------------------------------------------------------- choice


@pytest.mark.parametrize(
    ("solution", "truth", "score"),
    [
        ("The answer is \\boxed{B}.", "B", 1.0),
        ("\\boxed{b}", "B", 1.0),  # a single lower-case letter counts
        ("\\boxed{A, C}", "AC", 1.0),
        ("\\boxed{C and A}", "A, C", 1.0),
        ("\\boxed{(A)(C)}", ["A", "C"], 1.0),
        ("\\boxed{\\text{A}; \\text{C}}", "CA", 1.0),
        ("\\boxed{A} wait, no: \\boxed{D}", "A", 0.0),  # the last box counts
        ("\\boxed{A, C}", "A", 0.0),  # sets must be equal
        ("\\boxed{AB}", "A", 0.0),
        ("\\boxed{Paris}", "P", 0.0),  # not a letter answer
        ("\\boxed{12}", "A", 0.0),
        ("no box at all: A", "A", 0.0),
        ("\\boxed{}", "A", 0.0),
        ("\\boxed{A}", "", 0.0),  # unusable ground truth
    ],
)
def test_choice(solution: str, truth, score: float) -> None:
    assert choice.compute_score(solution, truth) == score


def test_choice_works_as_custom_function() -> None:
    fn = load_reward_function(choice.__file__, "compute_score")
    assert fn(data_source="mcq", solution_str="\\boxed{A}", ground_truth="A", extra_info={}) == 1.0


# ----------------------------------------------------------------------------- custom functions


@pytest.fixture()
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(
        textwrap.dedent(
            """
            NOT_A_FUNCTION = 3

            def length_score(data_source, solution_str, ground_truth, extra_info):
                return float(len(solution_str))

            def exact(data_source, solution_str, ground_truth, extra_info):
                ok = solution_str == ground_truth
                return {"score": 1.0 if ok else 0.0, "acc": ok, "note": data_source}

            def no_score(data_source, solution_str, ground_truth, extra_info):
                return {"acc": True}
            """
        )
    )
    return path


def test_load_reward_function_errors(reward_file: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_reward_function(str(tmp_path / "missing.py"), "f")
    with pytest.raises(AttributeError, match="no function 'nope'.*exact, length_score, no_score"):
        load_reward_function(str(reward_file), "nope")
    with pytest.raises(TypeError, match="not a function"):
        load_reward_function(str(reward_file), "NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("raise RuntimeError('bad module')\n")
    with pytest.raises(ImportError, match="bad module"):
        load_reward_function(str(broken), "f")


def test_combine(reward_file: Path) -> None:
    length = load_reward_function(str(reward_file), "length_score")
    exact = load_reward_function(str(reward_file), "exact")
    kwargs = {"data_source": "src", "solution_str": "abc", "ground_truth": "abc", "extra_info": None}
    assert combine([(length, 0.5)])(**kwargs) == 1.5
    assert combine([(exact, 2.0)])(**kwargs) == {"score": 2.0, "acc": True, "note": "src"}
    both = combine([(length, 0.5), (exact, 2.0)])(**kwargs)
    assert both == {"score": 3.5, "score_0": 3.0, "score_1": 1.0, "acc": True, "note": "src"}
    with pytest.raises(InvalidRewardError, match=r"my_reward.py:no_score returned a dict without a 'score' key"):
        combine([(load_reward_function(str(reward_file), "no_score"), 1.0)])(**kwargs)
    with pytest.raises(ValueError, match="at least one"):
        combine([])
    with pytest.raises(TypeError, match="not callable"):
        combine([(3, 1.0)])


# ----------------------------------------------------------------------------- overlong


def test_overlong_penalty_values() -> None:
    # max 20, buffer 8: free up to 12 tokens, then -factor * (L - 12) / 8
    out = overlong_penalty(torch.tensor([0, 12, 13, 16, 20]), 20, 8, 1.0)
    torch.testing.assert_close(out, torch.tensor([0.0, 0.0, -0.125, -0.5, -1.0]))
    out = overlong_penalty([16], 20, 8, 0.5, dtype=torch.float64)
    assert out.dtype == torch.float64 and out.item() == -0.25
    with pytest.raises(ValueError, match="must be > 0"):
        overlong_penalty([1], 20, 0, 1.0)
    with pytest.raises(ValueError, match="exceeds data.max_response_length"):
        overlong_penalty([1], 4, 8, 1.0)
