"""``megatron-dapo check CONFIG [overrides]``: everything a launch would trip over, found in one plain process.

Run it before ``torchrun``. It needs no process group, builds no model and reads no tensor:

* the config's keys and types (``megatron_dapo/config/``: ``from_dict``), the model's family from the HF
  ``config.json`` (``model.hf_config_dir``, else ``<checkpoint.load_dir>/hf_config`` as the trainer finds it), then
  every rule of the run in one pass, the gate ``train`` runs (``config.plan.plan_problems``): required keys, ranges,
  cross-field rules (``config/rules.py``) and the run's (``config/run_rules.py``): the actor layout against the world
  size and the model (heads / KV heads / FFN ÷ TP, layers ÷ PP × VPP), the rollout layout (plus the divisibility vLLM
  needs), the sequence budget against ``max_position_embeddings`` and ``rollout.max_num_batched_tokens``, mini-batches
  against the data-parallel size; then the run is laid out as the trainer resolves it (``config.plan.build_plan`` →
  ``RunPlan``, for the config's platform: nothing is imported to answer);
* every data file (``read_records`` + ``validate_row`` on every row; the chat template and tokenizer on the first
  ``sample_rows`` rows, reporting prompts over ``data.max_prompt_length`` under ``truncation=error``);
* the reward functions: imported, and called once per data source found, on that source's first row, with its
  ground truth as the response;
* the checkpoint at ``checkpoint.load_dir``: a Megatron checkpoint or HF directory whose architecture matches the
  HF config (``find_checkpoint``: what it is, its HF config, the manifest's sizes and the tensor index; no tensor data);
* a plan: sizes and batch arithmetic (``RunPlan``) and a per-rank memory plan by phase (``config.memory.memory_model``:
  ``startup``, the phases of a training step and ``save``; device and pinned-host bytes of every term under the
  plan's memory hand-off, activations under ``actor.recompute`` and the pipeline schedule, vLLM's start-up rule, the
  peak phase and whether it fits ``--device-memory-gb``; formulas in ``docs/check.md`` and in the output itself).

All problems are collected and reported together; the exit status is 1 when there is any, 0 (and ``OK``) otherwise.
Memory estimates over ``--device-memory-gb`` are warnings (marked ``OVER`` in the plan), not problems: they are
rough and do not fail the check. The exception is vLLM's start-up rule (free device memory when the engine is built
>= ``rollout.gpu_memory_utilization`` x the device memory): vLLM raises when it does not hold, so it is a problem.
``--json PATH`` (``-``: stdout, the text then goes to stderr) also writes the report as JSON (``CheckReport.to_json``).

Modules: ``runner`` (``run_check``: the stages in order), ``inputs`` (checkpoints, data, reward functions),
``render`` (the plan's text), ``report`` (``CheckReport``), ``command`` (``main``, ``build_parser``).
"""

from megatron_dapo.check.command import build_parser, main
from megatron_dapo.check.report import CheckReport
from megatron_dapo.check.runner import DEFAULT_SAMPLE_ROWS, run_check
from megatron_dapo.config.memory import PhaseMemory

__all__ = [
    "DEFAULT_SAMPLE_ROWS",
    "CheckReport",
    "PhaseMemory",
    "build_parser",
    "main",
    "run_check",
]
