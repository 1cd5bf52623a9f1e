"""Training checkpoints (``checkpoint``: megatron-core ``dist_checkpointing`` saves, manifests, resume) and HF export
(``export``).

No imports here: importing a submodule must not pull in megatron-core or the others.
"""
