"""The actor's optimizer: megatron-core's (distributed) Adam and its learning-rate scheduler, built from config.

Precision and the distributed-optimizer switch are read from the model chunks themselves (``TransformerConfig``
``bf16``/``fp16``/``params_dtype`` and the DDP wrapper's ``use_distributed_optimizer``): the optimizer must agree
with how the chunks were wrapped, so taking them from one place rules out a mismatch.

Weight decay follows megatron-core's default grouping (as Megatron-LM and verl's Megatron backend do): biases and
1-D parameters (norm weights) get no decay; every other parameter gets ``weight_decay`` (decoupled, AdamW).
"""

from __future__ import annotations

from typing import Any

from megatron_dapo.config import OptimConfig, warmup_steps


def build_optimizer(actor_chunks: list, optim: OptimConfig, total_steps: int) -> tuple[Any, Any]:
    """megatron-core ``get_megatron_optimizer`` (Adam) + ``OptimizerParamScheduler`` for the DDP-wrapped chunks.

    Schedule over ``total_steps`` *training* steps, as verl's Megatron worker does: the trainer calls
    ``scheduler.step(1)`` once per training step, after the actor update, so every optimizer step inside training
    step ``k`` (k = 0, 1, ...: mini-batches × ppo_epochs) uses the schedule's value at ``k``. Values: linear warm-up
    from 0 to ``lr`` over the warm-up steps, then ``constant`` at ``lr``, or ``cosine``/``linear`` decay from ``lr``
    to ``min_lr`` reached at ``total_steps``. Weight decay is constant.
    """
    # heavy: megatron-core, once the platform has patched it
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    if not actor_chunks:
        raise ValueError("build_optimizer: no model chunks given")
    warmup = warmup_steps(optim, total_steps)  # the schedule's rules ran in the gate (config/plan.resolve)
    model_config = actor_chunks[0].config
    ddp_config = getattr(actor_chunks[0], "ddp_config", None)
    if ddp_config is None:
        raise TypeError(
            "build_optimizer expects chunks wrapped by models.builder.wrap_for_training (megatron-core DDP), got "
            f"{type(actor_chunks[0]).__name__}"
        )
    config = OptimizerConfig(
        optimizer="adam",
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1,
        adam_beta2=optim.adam_beta2,
        adam_eps=optim.adam_eps,
        clip_grad=optim.clip_grad,
        bf16=bool(model_config.bf16),
        fp16=bool(model_config.fp16),
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=ddp_config.use_distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(config, actor_chunks)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=warmup,
        lr_decay_steps=total_steps,
        lr_decay_style=optim.lr_decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=total_steps,
        wd_incr_style="constant",
        # On resume the schedule's shape comes from this run's config; only the step counter comes from the
        # checkpoint (so a changed lr in the config takes effect, as in verl).
        use_checkpoint_opt_param_scheduler=False,
        override_opt_param_scheduler=True,
    )
    return optimizer, scheduler


def current_lr(optimizer) -> float:
    """The lr of the first parameter group (all groups share the schedule here)."""
    return float(optimizer.param_groups[0]["lr"])
