"""Helpers shared by the test suite (import as ``from tests.helpers import run_torchrun``)."""

from tests.helpers.torchrun import REPO_ROOT, run_torchrun

__all__ = ["REPO_ROOT", "run_torchrun"]
