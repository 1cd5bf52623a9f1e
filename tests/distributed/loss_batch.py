"""The fixed batch shared by the loss-invariance worker and its float64 reference."""

import torch

HF_KWARGS = dict(vocab_size=100, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2, tie_word_embeddings=True)
TEMPERATURE = 0.8
B, P, T = 8, 6, 7


def make_batch() -> dict:
    g = torch.Generator().manual_seed(123)
    prompt_lens = torch.tensor([6, 3, 5, 2, 6, 4, 1, 5])
    response_lens = torch.tensor([7, 2, 5, 7, 1, 4, 6, 3])
    prompts = torch.zeros(B, P, dtype=torch.long)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, T, dtype=torch.long)
    response_mask = torch.zeros(B, T, dtype=torch.long)
    for i in range(B):
        p, r = int(prompt_lens[i]), int(response_lens[i])
        prompts[i, P - p :] = torch.randint(3, 100, (p,), generator=g)
        prompt_mask[i, P - p :] = 1
        responses[i, :r] = torch.randint(3, 100, (r,), generator=g)
        response_mask[i, :r] = 1
    loss_mask = response_mask.clone()
    loss_mask[3] = 0  # a fully masked row (overlong filtering)
    mask_f = response_mask.float()
    return {
        "prompts": prompts,
        "prompt_mask": prompt_mask,
        "responses": responses,
        "response_mask": response_mask,
        "loss_mask": loss_mask,
        # Old/ref log-probs near plausible values so that some ratios clip on both sides.
        "old_log_probs": (-4.6 + 0.6 * torch.randn(B, T, generator=g)) * mask_f,
        "ref_log_probs": (-4.6 + 0.3 * torch.randn(B, T, generator=g)) * mask_f,
        "advantages": torch.randn(B, 1, generator=g).expand(B, T) * mask_f,
    }
