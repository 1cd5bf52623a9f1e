"""Training: the trainer loop (``trainer``), the Megatron actor (``actor``), optimizer and lr schedule
(``optimizer``), checkpoints (``checkpoint``), metrics (``metrics``), loggers (``loggers``) and timing (``timing``).

No imports here: importing a submodule must not pull in megatron-core, vLLM or the others.
"""
