"""Upgrade-readiness: megatron-core's private names (``_name``) are used only by the CPU shims
(``megatron_dapo/platform/cpu_shims.py``, each shim naming the megatron-core function it stands in for), so that moving
the megatron-core pin (``setup.py``) is a pin change plus that one module.

Scans every module's AST: names imported from ``megatron.core...`` that start with ``_``, and attributes starting with
``_`` read or set on a name bound to a megatron-core module or object imported from one."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_dapo"
SHIMS = PACKAGE / "platform" / "cpu_shims.py"


def _megatron_bindings(tree: ast.AST) -> tuple[set[str], list[str]]:
    """Local names bound to megatron-core imports, and private names imported directly."""
    bound: set[str] = set()
    private: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("megatron.core"):
            for alias in node.names:
                bound.add(alias.asname or alias.name)
                if alias.name.startswith("_"):
                    private.append(f"line {node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("megatron.core"):
                    bound.add(alias.asname or alias.name.split(".")[0])
    return bound, private


def private_megatron_uses(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bound, found = _megatron_bindings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            if node.attr.startswith("_") and not node.attr.startswith("__"):
                found.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_private_megatron_core_names_only_in_the_cpu_shims():
    offenders = {
        str(path.relative_to(PACKAGE.parent)): uses
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != SHIMS and (uses := private_megatron_uses(path))
    }
    assert not offenders, f"private megatron-core names outside platform/cpu_shims.py: {offenders}"


def test_the_scan_finds_private_names(tmp_path):
    """The scan itself can fail: a module reading a private attribute and importing a private name is reported."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from megatron.core.tensor_parallel import random as tp_random\n"
        "from megatron.core.transformer.moe.moe_utils import _private_helper\n"
        "tracker = tp_random._CUDA_RNG_STATE_TRACKER\n"
    )
    uses = private_megatron_uses(sample)
    assert len(uses) == 2 and "tp_random._CUDA_RNG_STATE_TRACKER" in uses[1]
    assert len(private_megatron_uses(SHIMS)) >= 5  # the shims do use them, by design
