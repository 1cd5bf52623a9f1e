"""The memory hand-off between the actor and the colocated engine (``offload``: which storages leave the device in
which phase, and their restore).

No imports here: importing a submodule must not pull in megatron-core or vLLM.
"""
