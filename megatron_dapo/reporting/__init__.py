"""What a run reports: the console (``console``), metric loggers (``loggers``), the step's metrics (``metrics``) and
timing (``timing``).

No imports here: importing a submodule must not pull in torch's heavier users or the others.
"""
