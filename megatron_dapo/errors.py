"""Errors shared by light modules (no torch): processes that run user code, such as the tool process
(``agent/host.py``), import them without importing the configuration package."""

from __future__ import annotations

from typing import Optional


class ConfigError(ValueError):
    """A configuration value is missing, unknown, of the wrong type or inconsistent with another value.

    ``problems`` lists every problem found (a check that collects several reports them all at once).
    """

    def __init__(self, message: str, problems: Optional[list[str]] = None) -> None:
        super().__init__(message)
        self.problems = problems if problems is not None else [message]

    @classmethod
    def of(cls, problems: list[str]) -> ConfigError:
        if len(problems) == 1:
            return cls(problems[0])
        return cls(f"{len(problems)} config problems:\n  - " + "\n  - ".join(problems), problems)
