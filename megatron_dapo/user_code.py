"""Importing user Python files named in the config (reward functions, advantage estimators, policy losses).

A file is imported once per process under a stable module name derived from its absolute path, and registered in
``sys.modules`` so that functions defined there pickle by reference (reward scorers run in worker processes).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from types import ModuleType

__all__ = ["load_python_file"]

_MODULES: dict[str, ModuleType] = {}


def load_python_file(path: str, what: str) -> ModuleType:
    """Import the Python file ``path`` (once per process). ``what`` names it in errors, e.g. "reward function file".

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: the file cannot be imported (the cause is chained).
    """
    abspath = os.path.abspath(os.path.expanduser(path))
    if abspath in _MODULES:
        return _MODULES[abspath]
    if not os.path.isfile(abspath):
        raise FileNotFoundError(f"{what} {path!r} does not exist (resolved to {abspath})")
    module_name = "_megatron_dapo_user_" + hashlib.sha1(abspath.encode()).hexdigest()[:16]
    spec = importlib.util.spec_from_file_location(module_name, abspath)
    if spec is None or spec.loader is None:
        raise ImportError(f"{what} {abspath} cannot be imported as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        sys.modules.pop(module_name, None)
        raise ImportError(f"importing {what} {abspath} failed: {exc!r}") from exc
    _MODULES[abspath] = module
    return module
