"""``python -m megatron_dapo.check CONFIG [overrides] [options]``: the same as ``megatron-dapo check``."""

from megatron_dapo.check.command import main

raise SystemExit(main())
