"""The actor and its Megatron plumbing: ``MegatronActor`` (forward/backward through megatron-core's schedules, the
loss hook, the guarded optimizer step; ``actor``), the optimizer and lr schedule (``optimizer``), MoE router losses and
expert load (``moe``) and routing replay (``router_replay``).

No imports here: importing a submodule must not pull in megatron-core or the others.
"""
