"""``TrainBatch`` (one padding rule: select, concat re-pads, shape checks) and ``make_micro_batch``'s left-aligned
re-layout, on hand-built rows."""

import pytest
import torch

from megatron_dapo.batch import TrainBatch, context_parallel_slice, make_micro_batch, pack_micro_batch


def two_rows(prompt_lens, response_lens, p, t, offset=0) -> TrainBatch:
    rows = len(prompt_lens)
    prompts = torch.zeros(rows, p, dtype=torch.long)
    prompt_mask = torch.zeros(rows, p, dtype=torch.long)
    responses = torch.zeros(rows, t, dtype=torch.long)
    response_mask = torch.zeros(rows, t, dtype=torch.long)
    for i, (n, m) in enumerate(zip(prompt_lens, response_lens)):
        prompts[i, p - n :] = torch.arange(1, n + 1) + 10 * (i + offset)
        prompt_mask[i, p - n :] = 1
        responses[i, :m] = torch.arange(1, m + 1) + 100 + 10 * (i + offset)
        response_mask[i, :m] = 1
    return TrainBatch(
        prompts=prompts,
        prompt_mask=prompt_mask,
        responses=responses,
        response_mask=response_mask,
        seq_rewards=torch.arange(rows, dtype=torch.float32) + offset,
        data_source=[f"src{i + offset}" for i in range(rows)],
    )


def test_concat_repads_to_the_longest_and_select_keeps_widths() -> None:
    a = two_rows([2, 1], [3, 1], p=2, t=3)
    b = two_rows([4], [1], p=4, t=1, offset=2)
    both = TrainBatch.concat([a, b])
    assert both.prompts.shape == (3, 4) and both.responses.shape == (3, 3)
    # prompts stay right-aligned (left padding), responses left-aligned (right padding); padding is 0
    assert both.prompts.tolist() == [[0, 0, 1, 2], [0, 0, 0, 11], [21, 22, 23, 24]]
    assert both.responses.tolist() == [[101, 102, 103], [111, 0, 0], [121, 0, 0]]
    assert both.loss_mask.tolist() == both.response_mask.tolist()  # defaults to a copy of response_mask
    assert both.seq_rewards.tolist() == [0.0, 1.0, 2.0] and both.data_source == ["src0", "src1", "src2"]
    assert both.sequence_lengths.tolist() == [5, 2, 5]
    picked = both.select([2, 0])
    assert picked.prompts.shape == (2, 4) and picked.data_source == ["src2", "src0"]
    assert picked.responses.tolist() == [[121, 0, 0], [101, 102, 103]]
    assert len(both.select(slice(1, 3))) == 2
    # a field only some parts have is dropped (it would be meaningless for the other rows)
    a.acc = torch.ones(2)
    assert TrainBatch.concat([a, b]).acc is None


def test_shape_checks_name_the_field() -> None:
    a = two_rows([1, 1], [1, 1], p=1, t=2)
    with pytest.raises(ValueError, match="TrainBatch.advantages has shape"):
        TrainBatch(
            prompts=a.prompts,
            prompt_mask=a.prompt_mask,
            responses=a.responses,
            response_mask=a.response_mask,
            advantages=torch.zeros(2, 3),
        )
    with pytest.raises(ValueError, match="TrainBatch.data_source has 1 rows"):
        TrainBatch(
            prompts=a.prompts,
            prompt_mask=a.prompt_mask,
            responses=a.responses,
            response_mask=a.response_mask,
            data_source=["x"],
        )


def test_micro_batch_is_left_aligned_and_trimmed() -> None:
    batch = two_rows([2, 1, 3], [3, 1, 2], p=3, t=3)
    batch.advantages = torch.arange(9, dtype=torch.float32).reshape(3, 3)
    mb = make_micro_batch(batch, [1, 0])
    # row 1: prompt [11], response [111]; row 0: prompt [1, 2], response [101, 102, 103] -> longest 5 tokens
    assert mb.tokens.tolist() == [[11, 111, 0, 0, 0], [1, 2, 101, 102, 103]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    # the logit predicting response token t sits at prompt_len - 1 + t (clamped inside the sequence)
    assert mb.response_index.tolist() == [[0, 1, 2], [1, 2, 3]]
    assert mb.advantages.tolist() == [[3.0, 4.0, 5.0], [0.0, 1.0, 2.0]]
    assert mb.old_log_probs is None and mb.response_mask.dtype == torch.bool
    # sequence parallelism: the length is rounded up to a multiple of TP
    assert make_micro_batch(batch, [1, 0], seq_multiple=4).tokens.shape == (2, 8)


@pytest.mark.parametrize("cp", [2, 3])
def test_context_parallel_slices_add_up_to_the_whole_sequence(cp: int) -> None:
    batch = two_rows([2, 1, 3], [3, 1, 2], p=3, t=3)
    batch.loss_mask[0, 1] = 0  # e.g. a masked token: stays masked on its rank
    mb = make_micro_batch(batch, [0, 1, 2], seq_multiple=2 * cp)
    seq_len = mb.tokens.shape[1]
    # A stand-in for the model's per-position output: its global position (logits would be [b, S, V]).
    full_out = torch.arange(seq_len).expand(3, -1)
    total = torch.zeros(3, 3, dtype=torch.long)
    covered = torch.zeros(3, 3, dtype=torch.long)
    for rank in range(cp):
        part = context_parallel_slice(mb, cp, rank)
        chunk = seq_len // (2 * cp)
        kept = list(range(rank * chunk, (rank + 1) * chunk)) + list(
            range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)
        )
        assert part.tokens.tolist() == mb.tokens[:, kept].tolist()
        assert part.position_ids.tolist() == mb.position_ids[:, kept].tolist()
        local_out = full_out[:, kept]  # what this rank's forward produces
        read = local_out.gather(1, part.response_index)
        total += read * part.response_mask
        covered += part.response_mask.long()
        assert (part.loss_mask <= part.response_mask.to(part.loss_mask.dtype)).all()
    # every response token is read on exactly one rank, at its global position
    assert covered.tolist() == mb.response_mask.long().tolist()
    assert total.tolist() == (mb.response_index * mb.response_mask).tolist()


def test_context_parallel_chunks_by_hand() -> None:
    batch = two_rows([3], [5], p=3, t=5)  # 8 tokens, CP=2: chunks of 2, rank 0 keeps 0 and 3, rank 1 keeps 1 and 2
    mb = make_micro_batch(batch, [0], seq_multiple=4)
    r0, r1 = context_parallel_slice(mb, 2, 0), context_parallel_slice(mb, 2, 1)
    assert r0.tokens.tolist() == [[1, 2, 104, 105]] and r1.tokens.tolist() == [[3, 101, 102, 103]]
    # response token t is predicted at position 2 + t: positions 2..6 -> rank 1 owns 2, 3, 4, 5; rank 0 owns 6
    assert r1.response_mask.tolist() == [[True, True, True, True, False]]
    assert r1.response_index.tolist()[0][:4] == [0, 1, 2, 3]
    assert r0.response_mask.tolist() == [[False, False, False, False, True]] and r0.response_index[0, 4] == 2
    with pytest.raises(ValueError, match="not a multiple of 2 x context_parallel_size=6"):
        context_parallel_slice(make_micro_batch(batch, [0], seq_multiple=4), 3, 0)


def test_packed_micro_batch_reads_the_same_tokens_and_positions() -> None:
    batch = two_rows([2, 1, 3], [3, 1, 2], p=3, t=3)
    mb = make_micro_batch(batch, [0, 1, 2])
    packed = pack_micro_batch(mb, row_multiple=2, total_multiple=4)
    # real lengths 5, 2, 5 -> padded to 6, 2, 6 (14), then 16 for the total multiple; positions restart per row
    assert packed.cu_seqlens.tolist() == [0, 5, 7, 12] and packed.cu_seqlens_padded.tolist() == [0, 6, 8, 16]
    assert packed.tokens.shape == (1, 16) and packed.max_seqlen == 8
    assert packed.tokens[0, :8].tolist() == [1, 2, 101, 102, 103, 0, 11, 111]
    assert packed.position_ids[0, :8].tolist() == [0, 1, 2, 3, 4, 0, 0, 1]
    valid = mb.response_mask
    rows = torch.arange(3).unsqueeze(-1).expand(-1, 3)
    # A position-wise model sees the same token at the same rotary position for every scored response token.
    assert torch.equal(packed.tokens[0][packed.response_index][valid], mb.tokens[rows, mb.response_index][valid])
    assert torch.equal(
        packed.position_ids[0][packed.response_index][valid], mb.position_ids[rows, mb.response_index][valid]
    )
    assert pack_micro_batch(packed) is packed
