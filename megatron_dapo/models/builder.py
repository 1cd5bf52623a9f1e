"""Build megatron-core ``GPTModel`` chunks (actor: trainable, DDP-wrapped; reference: frozen) from ``ModelArch``."""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_dapo import dtypes
from megatron_dapo.config import ActorConfig, ModelConfig, ParallelConfig
from megatron_dapo.models.families import ModelArch
from megatron_dapo.models.linear_attention import hybrid_block_spec, linear_attention_config_kwargs
from megatron_dapo.platform import get_platform
from megatron_dapo.weights.layout import padded_vocab_size


class RMSNorm(torch.nn.Module):
    """RMSNorm computed as HF does (fp32 statistics, weight applied in the input dtype).

    The weight carries ``sequence_parallel`` so megatron-core's ``finalize_model_grads`` all-reduces its gradient
    over TP when sequence parallelism splits the tokens (torch's own norm refuses SP in megatron-core's local spec).
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class QKRMSNorm(RMSNorm):
    """Per-head q/k norm: acts on TP-split heads, so it is not sequence-parallel (grads reduced by name)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(config, hidden_size, eps)
        self.weight.sequence_parallel = False


def recompute_kwargs(actor: Optional[ActorConfig]) -> dict:
    """``actor.recompute`` → megatron-core's activation recomputation: ``full`` recomputes whole layers in groups of
    ``recompute_num_layers`` (method ``uniform``), ``selective`` the core attention only, ``none`` nothing."""
    if actor is None or actor.recompute == "none":
        return {}
    if actor.recompute == "selective":
        return {"recompute_granularity": "selective"}
    if actor.recompute == "full":
        return {
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": actor.recompute_num_layers,
        }
    raise ValueError(f"actor.recompute={actor.recompute!r}: expected none, selective or full")


def transformer_config(
    arch: ModelArch,
    parallel: ParallelConfig,
    model: ModelConfig,
    actor: Optional[ActorConfig] = None,
    impl: str = "local",
):
    """``TransformerConfig`` for ``arch`` under ``parallel`` (+ the actor's recompute settings and the platform's
    ``transformer_config_overrides``: initialisation, p2p sync and fused kernels) for the resolved
    ``model.transformer_impl`` (the TE spec's grouped-GEMM experts come with TE)."""
    from megatron.core.transformer import TransformerConfig  # heavy: megatron-core, once the platform has patched it

    dtype = dtypes.from_config_name(model.params_dtype, "model.params_dtype")
    return TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        ffn_hidden_size=arch.ffn_hidden_size,
        kv_channels=arch.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        attention_softmax_in_fp32=True,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        context_parallel_size=parallel.context_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # Responses differ in length from step to step; p2p shapes are exchanged per micro-batch.
        variable_seq_lengths=True,
        moe_token_dispatcher_type="alltoall",  # avoids a MoE-only check that variable_seq_lengths trips
        # Interleaved (VPP) schedule: Megatron-LM's default p2p mode (overlapped, unbatched). The batched mode posts
        # sends/receives to both neighbours in one batch_isend_irecv, which deadlocks on gloo when PP=2 (previous
        # rank == next rank); the unbatched path orders them by even/odd rank.
        overlap_p2p_comm=parallel.virtual_pipeline_model_parallel_size is not None,
        batch_p2p_comm=parallel.virtual_pipeline_model_parallel_size is None,
        init_method_std=0.02,
        **moe_config_kwargs(arch, parallel, actor, grouped_gemm=impl == "transformer_engine"),
        **linear_attention_config_kwargs(arch),  # Qwen3-Next / Qwen3.5: Gated DeltaNet + gated attention
        **recompute_kwargs(actor),
        **get_platform().transformer_config_overrides(impl),  # fused kernels where the platform has them
    )


def moe_config_kwargs(
    arch: ModelArch, parallel: ParallelConfig, actor: Optional[ActorConfig] = None, grouped_gemm: bool = False
) -> dict:
    """MoE ``TransformerConfig`` fields for ``arch`` (none for a dense model).

    Router: HF ``norm_topk_prob=True`` (softmax over all experts → top-k → renormalise) equals megatron-core's
    ``moe_router_pre_softmax=False`` (top-k on the logits, softmax over the k); ``False`` is ``pre_softmax=True``.
    Router logits in fp32. Tokens move with the alltoall dispatcher (``variable_seq_lengths`` rules out allgather).
    Experts: with ``grouped_gemm`` (the TransformerEngine spec; MindSpeed on NPU) TE's grouped GEMM
    (``TEGroupedMLP``, parameters ``linear_fc{1,2}.weight{j}``, named back by ``families.from_te_name``), otherwise
    SequentialMLP; no fused permute / router kernels (extra packages). Router losses:
    ``moe_router_coefficients(arch, actor)``; the actor re-weights them per micro-batch (``actor/moe.py``).
    """
    if not arch.is_moe:
        return {}
    aux, z = moe_router_coefficients(arch, actor)
    return {
        "num_moe_experts": arch.num_experts,
        "moe_ffn_hidden_size": arch.moe_ffn_hidden_size,
        "moe_router_topk": arch.moe_router_topk,
        "moe_layer_freq": arch.moe_layer_freq,
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not arch.norm_topk_prob,
        "moe_router_topk_scaling_factor": None,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if aux > 0 else "none",
        "moe_aux_loss_coeff": aux,
        "moe_z_loss_coeff": z if z > 0 else None,
        "moe_grouped_gemm": grouped_gemm,
        "moe_permute_fusion": False,
        "moe_router_fusion": False,
        "expert_model_parallel_size": parallel.expert_model_parallel_size,
        "expert_tensor_parallel_size": parallel.expert_tensor_parallel_size,
        # Qwen2-MoE: a shared expert on every token, scaled by sigmoid(gate_weight · x)
        "moe_shared_expert_intermediate_size": arch.moe_shared_expert_ffn_hidden_size,
        "moe_shared_expert_gate": arch.moe_shared_expert_ffn_hidden_size is not None,
    }


def moe_router_coefficients(arch: ModelArch, actor: Optional[ActorConfig] = None) -> tuple[float, float]:
    """(load-balancing, z-loss) coefficients per MoE layer, megatron-core's definitions; 0 = off.

    ``actor.moe_aux_loss_coeff=None`` converts HF's ``router_aux_loss_coef`` c: transformers'
    ``load_balancing_loss_func`` is ``E · Σ_i f̄_i p̄_i`` with ``f̄_i``/``p̄_i`` the fraction of top-k assignments
    (summing to k) and the mean router probability of expert i, both averaged over the tokens of *all* MoE layers;
    megatron-core's ``switch_load_balancing_loss_func`` is ``(E/k) · Σ_i f_i p_i`` per layer, summed over the L MoE
    layers. Its gradient with respect to layer l's probabilities is ``c · (E/L) · f̄_i`` in HF and
    ``coeff · (E/k) · f_i^l`` in megatron-core, so ``coeff = c · k / L`` gives the same gradient whenever each layer's
    expert load equals the mean load over layers (exactly with one MoE layer), and the same value for uniform
    routing (HF: k, megatron-core: L x 1).
    """
    actor = actor if actor is not None else ActorConfig()
    aux = actor.moe_aux_loss_coeff
    if aux is None:
        layers = max(len(arch.moe_layers), 1)
        aux = arch.router_aux_loss_coef * arch.moe_router_topk / layers
    return float(aux), float(actor.moe_z_loss_coeff)


def resolve_transformer_impl(model: ModelConfig, parallel: ParallelConfig) -> str:
    """``model.transformer_impl`` on this platform (auto = the platform's default; ``transformer_engine`` raises TE's
    import error when it does not import), checked against ``parallel.context_parallel_size``."""
    platform = get_platform()
    impl = platform.resolve_transformer_impl(model.transformer_impl)
    platform.check_context_parallel(parallel.context_parallel_size, impl)
    return impl


def set_core_attention(spec, attention_backend: str) -> None:
    """The local spec's core attention by ``model.attention_backend``: ``sdpa`` = ``SDPAttention`` (torch's fused
    scaled_dot_product_attention kernels), ``local`` = megatron-core's ``DotProductAttention`` as the spec has it."""
    if attention_backend == "local":
        return
    if attention_backend != "sdpa":
        raise ValueError(f"model.attention_backend={attention_backend!r}: expected sdpa or local")
    # heavy: megatron-core (SDPAttention subclasses its DotProductAttention), once the platform has patched it
    from megatron_dapo.models.sdpa_attention import SDPAttention

    spec.submodules.self_attention.submodules.core_attention = SDPAttention


def layer_spec(
    arch: ModelArch,
    config,
    vp_stage: Optional[int] = None,
    impl: Optional[str] = None,
    attention_backend: str = "sdpa",
):
    """TransformerEngine spec (``impl="transformer_engine"``; on NPU MindSpeed implements it); otherwise
    megatron-core's local spec with SP-aware RMSNorms and the core attention of ``attention_backend``
    (``model.attention_backend``: ``set_core_attention``). ``impl=None``: the platform's default."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    if impl is None:
        impl = get_platform().resolve_transformer_impl("auto")
    if arch.gated_delta_net is not None:
        block = None if impl == "transformer_engine" else moe_layer_specs(config, vp_stage, impl, attention_backend)
        return hybrid_block_spec(arch, config, vp_stage, impl, block)
    if arch.is_moe:
        return moe_layer_specs(config, vp_stage, impl, attention_backend)
    if impl == "transformer_engine":
        return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
    spec = get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")
    sub = spec.submodules
    sub.input_layernorm = RMSNorm
    sub.pre_mlp_layernorm = RMSNorm
    if arch.qk_layernorm:
        sub.self_attention.submodules.q_layernorm = QKRMSNorm
        sub.self_attention.submodules.k_layernorm = QKRMSNorm
    set_core_attention(spec, attention_backend)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[spec] * num_layers, layer_norm=RMSNorm)


def moe_layer_specs(config, vp_stage: Optional[int], impl: str, attention_backend: str = "sdpa"):
    """Per-layer specs of an MoE model (dense or MoE MLP by ``config.moe_layer_freq``), this chunk's slice.

    megatron-core's ``get_gpt_decoder_layer_specs``; on the local spec the norms are the project's HF-exact
    ``RMSNorm``/``QKRMSNorm`` and the core attention is ``attention_backend``'s. The TE spec returns a block spec
    (megatron-core slices it for PP/VPP itself)."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_decoder_layer_specs
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if impl == "transformer_engine":
        return get_gpt_decoder_block_spec(
            config, use_transformer_engine=True, normalization="RMSNorm", vp_stage=vp_stage
        )
    specs = get_gpt_decoder_layer_specs(config, use_transformer_engine=False, normalization="RMSNorm")
    for spec in {id(s): s for s in specs}.values():
        sub = spec.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        if sub.mlp.module is not MLP:
            # An MoE layer's pre-MLP norm is a module of its own in the TE spec too (no linear_fc1 to fuse into):
            # keep its checkpoint key ``pre_mlp_layernorm.weight`` as Megatron-LM (TE) writes it.
            sub.sharded_state_dict_keys_map = {
                k: v for k, v in sub.sharded_state_dict_keys_map.items() if k != "pre_mlp_layernorm."
            }
        if config.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = QKRMSNorm
            sub.self_attention.submodules.k_layernorm = QKRMSNorm
        set_core_attention(spec, attention_backend)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=specs[offset : offset + count], layer_norm=RMSNorm)


def llama3_inv_freq(head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """Llama-3 rope frequencies with all four scaling parameters (megatron-core fixes three of them)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def build_gpt_chunks(
    arch: ModelArch,
    model_cfg: ModelConfig,
    parallel: ParallelConfig,
    actor: ActorConfig,
    transformer_impl: Optional[str] = None,
) -> list:
    """One ``GPTModel`` per virtual pipeline stage on this rank (a single chunk without VPP), from the ``model``,
    ``parallel`` and ``actor`` (recompute, MoE losses) sections. ``transformer_impl`` is the run's resolved one
    (``RunPlan.transformer_impl``); None = resolve ``model.transformer_impl`` here (tools and tests that build a
    model outside a training run)."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    impl = transformer_impl or resolve_transformer_impl(model_cfg, parallel)
    get_platform().configure_model_features(parallel, actor)
    config = transformer_config(arch, parallel, model_cfg, actor, impl=impl)
    vpp = parallel.virtual_pipeline_model_parallel_size
    tp = parallel.tensor_model_parallel_size
    vocab = padded_vocab_size(arch.vocab_size, model_cfg.make_vocab_size_divisible_by, tp)
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        model = GPTModel(
            config=config,
            transformer_layer_spec=layer_spec(arch, config, stage, impl, model_cfg.attention_backend),
            vocab_size=vocab,
            max_sequence_length=arch.max_position_embeddings,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage),
            parallel_output=True,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_percent=arch.rotary_percent,  # Qwen3-Next / Qwen3.5 rotate a quarter of each head
            rotary_base=int(arch.rope_theta) if float(arch.rope_theta).is_integer() else arch.rope_theta,
            vp_stage=stage,
        )
        if arch.llama3_rope_scaling is not None:
            model.rotary_pos_emb.inv_freq = llama3_inv_freq(
                arch.head_dim, arch.rope_theta, arch.llama3_rope_scaling
            ).to(model.rotary_pos_emb.inv_freq.device)
        model.to(get_platform().device())
        chunks.append(model)
    return chunks


def wrap_for_training(chunks: list, parallel: ParallelConfig) -> list:
    """Float16Module (bf16/fp16) + megatron-core DDP (``parallel``: its buckets and the distributed optimizer), as
    Megatron-LM's ``get_model`` does."""
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.module import Float16Module

    config = chunks[0].config
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=parallel.overlap_grad_reduce,
        bucket_size=parallel.ddp_bucket_size,
        use_distributed_optimizer=parallel.use_distributed_optimizer,
    )
    wrapped = []
    for i, model in enumerate(chunks):
        if config.bf16 or config.fp16:
            model = Float16Module(config, model)
        wrapped.append(
            DistributedDataParallel(
                config=config,
                ddp_config=ddp_config,
                module=model,
                disable_bucketing=i > 0,
            )
        )
    return wrapped


def freeze(chunks: list) -> list:
    """Reference model: no gradients, no optimizer state, eval mode."""
    for model in chunks:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
    return chunks


def unwrap(model):
    """DDP / Float16Module → the GPTModel inside."""
    while hasattr(model, "module"):
        model = model.module
    return model
