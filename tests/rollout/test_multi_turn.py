"""The multi-turn loop (``rollout/multi_turn.py``) on hand-built conversations: token alignment, loss masks, budget,
parser corner cases and concurrency.

The engine here is a scripted stand-in for vLLM's request-level API (one token per ``step`` per running request,
the turns' tokens fixed by the test), so that every token of the expected response is known; the e2e test
(``tests/e2e/test_agent_e2e.py``) runs the same loop on the real vLLM engine. The tokenizer is the real tiny HF
tokenizer and the tool turns come from its real chat template.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from megatron_dapo.agent.chat import ToolTurns, truncate_text
from megatron_dapo.agent.tools import ToolResult
from megatron_dapo.config.schema import MultiTurnConfig
from megatron_dapo.rollout.multi_turn import MultiTurnRollout, tool_metrics
from megatron_dapo.rollout.types import SamplingSpec, Segment
from megatron_dapo.testing.tokenizer import EOS_TOKEN, build_tiny_tokenizer

CALL_A = '<tool_call>{"name": "lookup", "arguments": {"box": "a"}}</tool_call>'
CALL_B = '<tool_call>{"name": "lookup", "arguments": {"box": "b"}}</tool_call>'


class ScriptedEngine:
    """Request-level engine stand-in: request ``k`` of sample (i, j) emits ``script[(i, j)][k]`` one token per step
    (cut at its ``max_tokens``: then it ends by budget). Records when requests are added and finish."""

    dp_size, dp_rank, tp_rank, pad_token_id = 1, 0, 0, 0

    def __init__(self, tokenizer, script: dict) -> None:
        self.tok, self.script = tokenizer, script
        self.running: dict[str, list] = {}
        self.events: list[tuple[float, str, str]] = []
        self.requests: list[tuple[str, list[int], int, tuple]] = []

    def add_request(self, request_id, token_ids, sampling, max_tokens, seed_key):
        i, j, turn = (int(x) for x in request_id.split("-"))
        text = self.script[(i, j)][turn]
        ids = self.tok.encode(text, add_special_tokens=False)
        self.running[request_id] = [ids[:max_tokens], 0, len(ids) > max_tokens]
        self.requests.append((request_id, list(token_ids), max_tokens, seed_key))
        self.events.append((time.perf_counter(), "add", request_id))

    def step(self):
        time.sleep(0.002)
        done = []
        for rid, state in list(self.running.items()):
            state[1] += 1
            if state[1] >= len(state[0]):
                ids = state[0]
                done.append((rid, Segment(ids, [-0.5] * len(ids), state[2])))
                del self.running[rid]
                self.events.append((time.perf_counter(), "end", rid))
        return done

    def has_unfinished(self):
        return bool(self.running)

    def seeded_session(self, run, seed_offset):
        return run()

    def gather_objects(self, objects):
        return list(objects)

    def broadcast_in_replica(self, obj):
        return obj


class ThreadTools:
    """The ``ToolExecutor`` protocol over a thread pool: ``answers[box]`` after ``delays[box]`` seconds."""

    def __init__(self, answers: dict, delays: dict | None = None) -> None:
        self.answers, self.delays = answers, delays or {}
        self.pool = ThreadPoolExecutor(8)
        self.created, self.released, self.calls = [], [], []
        self.lock = threading.Lock()

    def _done(self, value) -> Future:
        f: Future = Future()
        f.set_result(value)
        return f

    def create(self, instance_id, tools_kwargs):
        self.created.append((instance_id, tools_kwargs))
        return self._done(None)

    def call(self, instance_id, call):
        def run():
            box = call.arguments.get("box")
            time.sleep(self.delays.get(box, 0.0))
            with self.lock:
                self.calls.append((instance_id, box, time.perf_counter()))
            if call.error:
                return ToolResult(f"error: {call.error}", status="bad_call")
            return ToolResult(self.answers[box], reward=0.25, latency_s=0.01)

        return self.pool.submit(run)

    def release(self, instance_id):
        self.released.append(instance_id)
        return self._done(None)

    def close(self):
        self.pool.shutdown()


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), extra_texts=[])


def sampling(n: int = 1) -> SamplingSpec:
    return SamplingSpec(n=n, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=999, stop_token_ids=(2,))


def items(n_prompts: int, tok) -> list[dict]:
    out = []
    for i in range(n_prompts):
        messages = [{"role": "user", "content": f"open {i}"}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        kwargs = {"lookup": {"create_kwargs": {"secret": i}}}
        out.append({"input_ids": tok.encode(text), "prompt_messages": messages, "extra_info": {"tools_kwargs": kwargs}})
    return out


def rollout(tok, script, tools, budget=200, **cfg):
    engine = ScriptedEngine(tok, script)
    mt = MultiTurnConfig(enable=True, tool_config_path="unused", **cfg)
    return engine, MultiTurnRollout(engine, tools, ToolTurns(tok, mt.max_tool_response_length), tok, mt, budget)


def ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def test_tool_turn_tokens_follow_the_chat_template(tok):
    turns = ToolTurns(tok)
    # The default tiny template renders any role as <|im_start|>role\n...<|im_end|>\n; the model's own <|im_end|>
    # ends its turn, so the tool turn starts with the template's newline after it.
    assert turns.tail(["7"]) == "\n<|im_start|>tool\n7<|im_end|>\n<|im_start|>assistant\n"
    assert (
        turns.tail(["1", "2"])
        == "\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert turns.tokens(["7"]) == ids(tok, turns.tail(["7"]))
    assert truncate_text("abcdefghij", 4, "middle") == "ab...ij"
    assert truncate_text("abcdefghij", 4, "left") == "...ghij"
    assert truncate_text("abcdefghij", 4, "right") == "abcd..."


def test_tokens_masks_and_log_probs_line_up(tok):
    script = {
        (0, 0): [CALL_A + EOS_TOKEN, "7" + EOS_TOKEN],
        (0, 1): ["3" + EOS_TOKEN],  # answers without a tool: one turn
    }
    tools = ThreadTools({"a": "7"})
    engine, mt = rollout(tok, script, tools)
    batch = mt.generate(items(1, tok), sampling(n=2), seed_offset=5)
    turns = ToolTurns(tok)
    t0, tail, t1 = ids(tok, CALL_A + EOS_TOKEN), turns.tokens(["7"]), ids(tok, "7" + EOS_TOKEN)
    expected = t0 + tail + t1
    n = len(expected)
    assert batch.responses[0, :n].tolist() == expected
    assert batch.loss_mask[0, :n].tolist() == [1] * len(t0) + [0] * len(tail) + [1] * len(t1)
    assert batch.rollout_log_probs[0, :n].tolist() == [-0.5] * len(t0) + [0.0] * len(tail) + [-0.5] * len(t1)
    assert batch.response_mask[0].sum().item() == n and not bool(batch.truncated[0])
    assert batch.loss_mask[1].tolist()[:2] == [1, 1] and batch.loss_mask[1].sum().item() == 2
    # The next turn's request is the prompt and everything so far, with the room left; seeds keyed per turn.
    prompt = items(1, tok)[0]["input_ids"]
    second = [r for r in engine.requests if r[0] == "0-0-1"][0]
    assert second[1] == prompt + t0 + tail and second[2] == 200 - len(t0) - len(tail)
    assert [r[3] for r in engine.requests if r[0].startswith("0-0")] == [(5, 0, 0), (5, 0, "0.1")]
    info = batch.turns[0]
    assert info["num_turns"] == 2 and info["tool_rewards"] == [0.25] and info["tool_status"] == ["ok"]
    assert [m["role"] for m in info["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert info["messages"][1]["content"] == CALL_A and info["messages"][3]["content"] == "7"
    assert tools.created[0] == ("0-0", {"lookup": {"create_kwargs": {"secret": 0}}})
    assert sorted(tools.released) == ["0-0", "0-1"]


def test_tool_output_with_a_call_string_is_not_parsed(tok):
    script = {(0, 0): [CALL_A + EOS_TOKEN, "done" + EOS_TOKEN]}
    tools = ThreadTools({"a": CALL_B})  # the tool's text looks like a call: it is data, not a model turn
    _, mt = rollout(tok, script, tools)
    batch = mt.generate(items(1, tok), sampling())
    assert batch.turns[0]["num_turns"] == 2 and batch.turns[0]["tool_calls"] == 1
    assert [c[1] for c in tools.calls] == ["a"]


def test_a_call_cut_by_the_budget_ends_the_response_truncated(tok):
    budget = 20  # the call alone is longer
    script = {(0, 0): [CALL_A + EOS_TOKEN]}
    tools = ThreadTools({"a": "7"})
    _, mt = rollout(tok, script, tools, budget=budget)
    batch = mt.generate(items(1, tok), sampling())
    assert batch.response_mask[0].sum().item() == budget and bool(batch.truncated[0])
    assert batch.loss_mask[0].sum().item() == budget and tools.calls == []


def test_two_calls_in_one_turn_and_an_empty_result(tok):
    script = {(0, 0): [CALL_A + CALL_B + EOS_TOKEN, "ok" + EOS_TOKEN]}
    tools = ThreadTools({"a": "", "b": "9"})
    _, mt = rollout(tok, script, tools, max_parallel_calls=2)
    batch = mt.generate(items(1, tok), sampling())
    turns = ToolTurns(tok)
    t0, tail = ids(tok, CALL_A + CALL_B + EOS_TOKEN), turns.tokens(["", "9"])
    n = len(t0) + len(tail) + 3
    assert batch.responses[0, :n].tolist() == t0 + tail + ids(tok, "ok" + EOS_TOKEN)
    assert batch.loss_mask[0, :n].tolist() == [1] * len(t0) + [0] * len(tail) + [1] * 3
    assert [m["content"] for m in batch.turns[0]["messages"] if m["role"] == "tool"] == ["", "9"]
    # max_parallel_calls=1 keeps the first call only (verl)
    _, mt1 = rollout(tok, script, ThreadTools({"a": "", "b": "9"}))
    assert mt1.generate(items(1, tok), sampling()).turns[0]["tool_calls"] == 1


def test_malformed_call_is_answered_and_turn_limit_holds(tok):
    script = {(0, 0): ["<tool_call>{not json}</tool_call>" + EOS_TOKEN, CALL_A + EOS_TOKEN, "x" + EOS_TOKEN]}
    tools = ThreadTools({"a": "7"})
    _, mt = rollout(tok, script, tools, budget=400, max_assistant_turns=2)
    batch = mt.generate(items(1, tok), sampling())
    info = batch.turns[0]
    assert info["num_turns"] == 2 and info["tool_status"] == ["bad_call"]  # the 2nd turn's call is not run
    assert info["messages"][2]["content"].startswith("error: the tool call is not valid JSON")
    assert not bool(batch.truncated[0])


def test_a_tool_turn_past_the_budget_is_cut(tok):
    t0 = ids(tok, CALL_A + EOS_TOKEN)
    budget = len(t0) + 5
    script = {(0, 0): [CALL_A + EOS_TOKEN]}
    _, mt = rollout(tok, script, ThreadTools({"a": "a long tool answer"}), budget=budget)
    batch = mt.generate(items(1, tok), sampling())
    assert batch.response_mask[0].sum().item() == budget and bool(batch.truncated[0])
    assert batch.loss_mask[0].tolist() == [1] * len(t0) + [0] * 5


def test_other_samples_decode_while_a_tool_runs(tok):
    """No barrier per turn: sample 0's slow tool does not hold sample 1's three turns back."""
    script = {
        (0, 0): [CALL_A + EOS_TOKEN, "1" + EOS_TOKEN],
        (1, 0): [CALL_B + EOS_TOKEN, CALL_B + EOS_TOKEN, "2" + EOS_TOKEN],
    }
    tools = ThreadTools({"a": "1", "b": "2"}, delays={"a": 0.6})
    engine, mt = rollout(tok, script, tools)
    batch = mt.generate(items(2, tok), sampling())
    slow_done = [t for _, box, t in tools.calls if box == "a"][0]
    fast_last = [t for t, kind, rid in engine.events if kind == "end" and rid == "1-0-2"][0]
    assert fast_last < slow_done
    assert [info["num_turns"] for info in batch.turns] == [2, 3]
    metrics = tool_metrics(batch.turns)
    assert metrics["tool/calls"] == 3.0 and metrics["tool/called_frac"] == 1.0
    assert metrics["tool/turns_per_sample"] == 2.5 and metrics["tool/error"] == 0.0


def test_a_hung_call_is_abandoned_and_only_its_conversation_reads_it(tok):
    """``tool_abandon_after_s``: once the engine has nothing left to run, a conversation whose call has run that long
    reads an ``abandoned`` error and answers; the batch does not wait for the call. Without it, the batch waits."""
    script = {
        (0, 0): [CALL_A + EOS_TOKEN, "1" + EOS_TOKEN],
        (1, 0): [CALL_B + EOS_TOKEN, "2" + EOS_TOKEN],
    }
    hang_s = 1.5
    walls, batches = {}, {}
    for after_s in (0.2, None):
        tools = ThreadTools({"a": "1", "b": "2"}, delays={"b": hang_s})
        _, mt = rollout(tok, script, tools, tool_abandon_after_s=after_s)
        start = time.perf_counter()
        batches[after_s] = mt.generate(items(2, tok), sampling())
        walls[after_s] = time.perf_counter() - start
        tools.close()
    assert walls[0.2] < hang_s / 2 and walls[None] >= hang_s, walls
    quick, waited = batches[0.2], batches[None]
    assert [info["tool_status"] for info in quick.turns] == [["ok"], ["abandoned"]]
    assert [info["tool_status"] for info in waited.turns] == [["ok"], ["ok"]]

    def response(batch, row):
        return batch.responses[row][batch.response_mask[row].bool()].tolist()

    abandoned = tok.decode(response(quick, 1))
    assert "the call was abandoned" in abandoned and abandoned.rstrip().endswith("2" + EOS_TOKEN), abandoned
    assert response(quick, 0) == response(waited, 0)  # the other conversation is untouched
    assert quick.loss_mask[1].sum() == waited.loss_mask[1].sum()  # the error is a tool turn: not trained
    metrics = tool_metrics(quick.turns)
    assert metrics["tool/abandoned"] == 1.0 and metrics["tool/timeout"] == 0.0 and metrics["tool/calls"] == 2.0


def test_tool_tokens_get_no_advantage_and_the_reward_sees_the_conversation(tok):
    """The multi-turn batch downstream: ``score_to_batch``'s inputs carry the conversation, the loss mask starts from
    the sampled tokens and the advantages are zero on tool turns (float64 by hand: GRPO over two samples)."""
    import torch

    from megatron_dapo.batch import TrainBatch
    from megatron_dapo.config.schema import AlgorithmConfig
    from megatron_dapo.training.advantage_stage import batch_advantages
    from megatron_dapo.training.reward_stage import reward_inputs

    script = {(0, 0): [CALL_A + EOS_TOKEN, "7" + EOS_TOKEN], (0, 1): [CALL_A + EOS_TOKEN, "3" + EOS_TOKEN]}
    _, mt = rollout(tok, script, ThreadTools({"a": "7"}))
    its = [{**items(1, tok)[0], "data_source": "lookup", "ground_truth": "7"}]
    rollout_batch = mt.generate(its, sampling(n=2))
    _, truths, extras = reward_inputs(rollout_batch, its)
    assert truths == ["7", "7"] and extras[0]["tools_kwargs"] == its[0]["extra_info"]["tools_kwargs"]
    assert [m["content"] for m in extras[1]["messages"]][-1] == "3" and extras[1]["tool_rewards"] == [0.25]

    scores = torch.zeros_like(rollout_batch.rollout_log_probs)
    lengths = rollout_batch.response_lengths
    scores[0, lengths[0] - 1] = 1.0  # sample 0 answered 7
    batch = TrainBatch(
        prompts=rollout_batch.prompts,
        prompt_mask=rollout_batch.prompt_mask,
        responses=rollout_batch.responses,
        response_mask=rollout_batch.response_mask,
        loss_mask=rollout_batch.loss_mask.clone(),
        sampled_mask=rollout_batch.loss_mask,
        rollout_log_probs=rollout_batch.rollout_log_probs,
        token_level_scores=scores,
        group_ids=["g", "g"],
        filler=torch.zeros(2, dtype=torch.bool),
    )
    batch_advantages(batch, AlgorithmConfig(adv_estimator="grpo"), kl_ctrl=None, is_threshold=None)
    # GRPO over the group {1, 0}: (1 - 0.5) / std([1, 0]) = 0.5 / 0.7071 on every sampled token, 0 on tool turns
    expected = 0.5 / torch.tensor([1.0, 0.0], dtype=torch.float64).std().item()
    sampled = batch.model_mask.bool()
    assert torch.allclose(batch.advantages[0][sampled[0]], torch.tensor(expected), atol=1e-6)
    assert torch.allclose(batch.advantages[1][sampled[1]], torch.tensor(-expected), atol=1e-6)
    assert bool((batch.advantages[~sampled] == 0).all()) and int((~sampled & batch.response_mask.bool()).sum()) > 0


SCORE_BY_TURNS = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return {"score": extra_info["num_turns"] + float(ground_truth in solution_str), "turns": extra_info["num_turns"]}
"""


def test_conversations_are_scored_as_they_end(tok, tmp_path):
    """``reward.overlap_generation`` in a multi-turn rollout: each conversation reaches the scoring sink once, in the
    engine step it ends (a tool call makes it end later), with its conversation; the rewards equal those of scoring
    the finished batch. Without a scorer for the data source, the error is raised by the collection, not the sink."""
    from megatron_dapo.config import ConfigError, CustomFunctionConfig, RewardConfig
    from megatron_dapo.reward.manager import RewardManager
    from megatron_dapo.training.reward_stage import RolloutScorer

    fn = tmp_path / "by_turns.py"
    fn.write_text(SCORE_BY_TURNS)
    script = {
        (0, 0): ["7" + EOS_TOKEN],
        (0, 1): [CALL_A + EOS_TOKEN, "3" + EOS_TOKEN],
        (1, 0): ["long answer 7" + EOS_TOKEN],
        (1, 1): [CALL_B + EOS_TOKEN, "no" + EOS_TOKEN],
    }
    its = [{**it, "data_source": "lookup", "ground_truth": "7"} for it in items(2, tok)]
    cfg = RewardConfig(custom_function=CustomFunctionConfig(path=str(fn)), num_workers=0)
    reward = RewardManager(tok, cfg, max_response_length=200)
    scorer = RolloutScorer(reward, world_size=1, rank=0, replica=(0, 1))
    flight = scorer.start(its, 2)
    steps: list[list] = []

    def sink(done):
        steps.append(done)
        flight(done)

    _, mt = rollout(tok, script, ThreadTools({"a": "7", "b": "8"}))
    batch = mt.generate(its, sampling(n=2), on_step=sink)
    overlapped = scorer(batch, its, flight)
    after = RolloutScorer(reward, world_size=1, rank=0)(batch, its)

    ended_at = {(p, s): k for k, done in enumerate(steps) for p, s, _, _ in done}
    assert sorted(ended_at) == [(0, 0), (0, 1), (1, 0), (1, 1)] and sum(len(d) for d in steps) == 4
    assert ended_at[(0, 0)] < ended_at[(1, 0)] < ended_at[(0, 1)]  # one turn ends first; a tool turn ends later
    for p, s, tokens, info in (row for done in steps for row in done):
        row = 2 * p + s
        assert tokens == batch.responses[row, : batch.response_lengths[row]].tolist()
        assert info["num_turns"] == batch.turns[row]["num_turns"]
    # turns + 1 where the response holds the answer 7 (sample (0, 1) reads it in its tool turn)
    assert overlapped.scores.tolist() == after.scores.tolist() == [2.0, 3.0, 2.0, 2.0]
    assert overlapped.extra["turns"] == [1, 2, 1, 2]
    assert overlapped.metrics["reward/scored_during_gen"] == 0.0  # in-process scoring runs at the collection

    unrouted = RolloutScorer(RewardManager(tok, RewardConfig(num_workers=0), 200), 1, 0, (0, 1))
    flight = unrouted.start(its, 2)
    _, mt = rollout(tok, script, ThreadTools({"a": "7", "b": "8"}))
    batch = mt.generate(its, sampling(n=2), on_step=flight)  # the sink keeps the error...
    with pytest.raises(ConfigError, match="lookup"):
        unrouted(batch, its, flight)  # ...and the collection raises it


LAST_ANSWER = """
def compute_score(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip().endswith(ground_truth))
"""


class _ModelTermThatMustNotRun:
    """A reward model / judge stand-in that fails the test if validation scores with it."""

    def score(self, *args, **kwargs):
        raise AssertionError("validation ran a model-based reward term")

    def close(self) -> None:
        pass


def test_validation_scores_rule_based_accuracy_without_the_model_terms(tok, tmp_path):
    """``validation_metrics`` reports accuracy only, so it scores with ``RolloutScorer.rule_based()``: the reward model
    and the judge (their forwards: a whole model, or a second engine's generation) are not run, as verl's
    ``_validate`` skips model-based rewards; the accuracy is the rule-based one."""
    from megatron_dapo.config import AlgorithmConfig, CustomFunctionConfig, RewardConfig
    from megatron_dapo.reward.manager import RewardManager
    from megatron_dapo.training.reward_stage import RolloutScorer
    from megatron_dapo.training.rollout_phase import validation_metrics

    fn = tmp_path / "last_answer.py"
    fn.write_text(LAST_ANSWER)
    script = {(0, 0): ["7" + EOS_TOKEN], (1, 0): [CALL_A + EOS_TOKEN, "3" + EOS_TOKEN]}
    its = [{**it, "data_source": "lookup", "ground_truth": "7"} for it in items(2, tok)]
    cfg = RewardConfig(custom_function=CustomFunctionConfig(path=str(fn)), num_workers=0)
    reward = RewardManager(tok, cfg, max_response_length=200)
    forbidden = _ModelTermThatMustNotRun()
    scorer = RolloutScorer(reward, 1, 0, reward_model=forbidden, judge=forbidden)
    plain = scorer.rule_based()
    assert (plain.reward, plain.reward_model, plain.judge) == (reward, None, None)
    _, mt = rollout(tok, script, ThreadTools({"a": "7", "b": "8"}))
    metrics = validation_metrics(mt, scorer, AlgorithmConfig(), its, sampling(n=1))
    accuracy = [v for k, v in metrics.items() if k.startswith("val-core/") and "acc" in k]
    assert accuracy == [0.5], metrics  # row 0 answers 7, row 1 answers 3 (after reading 7 from its tool)
