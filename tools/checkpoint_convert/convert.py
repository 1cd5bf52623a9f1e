#!/usr/bin/env python
"""HF ⇄ Megatron checkpoint conversion (thin wrapper over ``megatron_dapo.weights.convert``).

python tools/checkpoint_convert/convert.py hf-to-mcore --hf-dir H --save-dir M [--dtype bf16]  # no --tp/--pp
python tools/checkpoint_convert/convert.py mcore-to-hf --load-dir M --save-dir H2 [--hf-config-dir H]
"""

import sys

from megatron_dapo.weights.convert import main

if __name__ == "__main__":
    sys.exit(main())
