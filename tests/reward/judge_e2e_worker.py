"""torchrun worker for ``test_judge_e2e.py``: a colocated rollout engine and the judge's engine in the same processes.

Run as ``torchrun --nproc-per-node 2 tests/reward/judge_e2e_worker.py --actor-dir A --judge-dir J --tokenizer T
--out F``. The rollout engine (rollout TP 1: two replicas) generates a batch; the real reward stage
(``score_to_batch`` with the arithmetic reward function and the judge) scores it; then each rank calls the judge's
``vllm.LLM`` directly on every judge input, with the same sampling parameters, as the reference. Each rank writes
``F.rank<r>.json``.
"""

from __future__ import annotations

import argparse
import json
import time

T0 = time.perf_counter()

PROMPTS = [("3+4=", "7"), ("12-5=", "7"), ("2*3=", "6"), ("9+9=", "18" * 30)]  # the last is too long to judge


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--actor-dir", required=True)
    p.add_argument("--judge-dir", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()

    import torch
    from transformers import AutoTokenizer

    from megatron_dapo.config import load_config
    from megatron_dapo.judge.judge_engine import judge_seed
    from megatron_dapo.judge.judge_scorer import JudgeScorer
    from megatron_dapo.parallel import init_distributed, teardown
    from megatron_dapo.reward.manager import RewardManager
    from megatron_dapo.rollout.engine import RolloutEngine
    from megatron_dapo.training.reward_stage import RolloutScorer, score_to_batch
    from tests.helpers.engines import engine_sections

    cfg = load_config(
        None,
        [
            "parallel.platform=cpu",
            "model.params_dtype=fp32",
            "rollout.tensor_model_parallel_size=1",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "rollout.seed=3",
            "rollout.kv_cache_memory_mb=16",
            "rollout.max_num_seqs=16",
            "data.max_prompt_length=24",
            "data.max_response_length=8",
            "reward.num_workers=0",
            "reward.error_score=-0.5",
            "reward.custom_function.path=megatron_dapo/tasks/arithmetic.py",
            "reward.custom_function.name=compute_score_exact",
            f"reward.judge.model_path={args.judge_dir}",
            f"reward.judge.tokenizer_path={args.tokenizer}",
            "reward.judge.prompt_template='{prompt}|{response}|{ground_truth}>'",
            "reward.judge.parser=last_number",
            "reward.judge.weight=0.25",
            "reward.judge.score_range=[0, 5]",
            "reward.judge.temperature=1.0",
            "reward.judge.max_tokens=6",
            "reward.judge.seed=11",
            "reward.judge.max_prompt_length=64",
            "reward.judge.dtype=fp32",
            "reward.judge.kv_cache_memory_mb=16",
            "reward.judge.max_num_seqs=16",
            "trainer.output_dir=" + args.out + ".d",
        ],
    )
    info, platform = init_distributed(cfg.parallel)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    items = []
    for text, truth in PROMPTS:
        messages = [{"role": "user", "content": text}]
        raw = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        items.append(
            {
                "input_ids": tokenizer.encode(raw),
                "raw_prompt": raw,
                "prompt_messages": messages,
                "data_source": "arithmetic",
                "ground_truth": truth,
                "extra_info": {},
            }
        )
    res: dict = {"rank": info.rank}
    t = time.perf_counter()
    engine = RolloutEngine(*engine_sections(cfg), args.actor_dir, platform, pad_token_id=0, eos_token_ids=[2])
    judge = JudgeScorer.build(cfg.reward, engine.rollout_plan, platform, tokenizer, cfg.trainer.collective_timeout_s)
    res["engines_start_s"] = time.perf_counter() - t
    rollout = engine.generate([it["input_ids"] for it in items], engine.train_sampling(), seed_offset=1)

    reward = RewardManager(tokenizer, cfg.reward, cfg.data.max_response_length, [2])
    scorer = RolloutScorer(reward, info.world_size, info.rank, None, None, judge)
    t = time.perf_counter()
    batch, metrics = score_to_batch(scorer, cfg.algorithm, rollout, items)
    res["score_s"] = time.perf_counter() - t
    res["metrics"] = metrics
    res["seq_rewards"] = batch.seq_rewards.tolist()
    res["verifier_scores"] = batch.verifier_scores.tolist()

    # The reference: the judge's own vLLM engine, called directly on every judge input with the same parameters.
    from vllm import SamplingParams

    inputs = judge.inputs(rollout, items)
    res["input_lengths"] = [len(x) for x in inputs]
    res["input_text"] = judge.tokenizer.decode(inputs[0])
    sent = [i for i, x in enumerate(inputs) if len(x) <= cfg.reward.judge.max_prompt_length]  # vLLM refuses others
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=6,
            ignore_eos=True,
            stop_token_ids=[2],
            seed=judge_seed(11, inputs[i]),
            detokenize=False,
        )
        for i in sent
    ]
    outs = judge.engine.llm.generate([{"prompt_token_ids": inputs[i]} for i in sent], params, use_tqdm=False)
    res["direct_answers"] = [""] * len(inputs)
    for i, o in zip(sent, outs):
        res["direct_answers"][i] = judge.tokenizer.decode(o.outputs[0].token_ids, skip_special_tokens=True)
    res["answers"] = reward_answers = judge.judge(inputs).answers
    res["stage_answers_again"] = reward_answers == judge.judge(inputs).answers  # deterministic given the seed
    scorer.close()
    res["total_s"] = time.perf_counter() - T0
    with open(f"{args.out}.rank{info.rank}.json", "w") as f:
        json.dump(res, f)
    torch.distributed.barrier()
    teardown(engine)


if __name__ == "__main__":
    main()
