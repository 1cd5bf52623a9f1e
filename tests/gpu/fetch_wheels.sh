#!/usr/bin/env bash
# On a machine with the package registry (our CPU box): the wheels the GPU check needs beyond a plain PyTorch install,
# for the lent machine's Python (cp312, x86_64), into tests/gpu/wheels/ (ignored by git; the device tool's `carry`
# takes the folder, 64 MiB at most). run.sh installs them there with --no-deps.
#   bash tests/gpu/fetch_wheels.sh [PYTHON_VERSION]   (default 3.12)
# megatron-core (2.6 MB); fla's pure-Python Triton kernels for the gdn_fla phase (fla-core holds fla.ops and
# fla.modules, which megatron-core's GatedDeltaNet imports; about 1.5 MB together). Their other needs (einops, triton,
# transformers) are on the lent machine's image.
set -euo pipefail
DEST="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/wheels"
PYV="${1:-3.12}"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$DEST" megatron-core==0.16.1 fla-core==0.6.0 flash-linear-attention==0.6.0
du -sh "$DEST"
