"""``megatron-dapo eval`` as a torchrun worker script (the CLI module itself cannot be the script: run from inside
the package directory, its ``platform/`` would shadow the standard library's ``platform``)."""

import sys

from megatron_dapo.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
