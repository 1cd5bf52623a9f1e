"""Built-in tools: ``python`` (code in a limited subprocess) and ``calculator`` (arithmetic, no code).

``PythonTool`` runs each call's ``code`` in a fresh ``python -I`` subprocess, in an empty temporary directory, with
an environment that holds only ``PATH`` (no inherited secrets, tokens or proxies), under ``RLIMIT_CPU``
(``cpu_time_s``), ``RLIMIT_AS`` (``memory_mb``) and a wall-clock timeout; stdout (and, on failure, the end of stderr)
is returned, cut to ``max_output_chars``. What it does **not** isolate: the filesystem (the code runs as the
trainer's user and can read and write what that user can), the network, and other processes — run it in a
container or a sandbox service when prompts or models are untrusted.
"""

from __future__ import annotations

import ast
import operator
import os
import resource
import subprocess
import sys
import tempfile
from typing import Any, Optional

from megatron_dapo.agent.tools import BaseTool

__all__ = ["CalculatorTool", "PythonTool", "evaluate_arithmetic"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPONENT = 64  # 2 ** huge would hang the tool: refuse large powers instead


def evaluate_arithmetic(expression: str) -> float:
    """The value of an arithmetic expression of numbers, + - * / // % ** and parentheses; ``ValueError`` otherwise."""

    def value(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return value(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is too large (at most {MAX_EXPONENT})")
            return _BINARY[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](value(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"cannot parse {expression!r}: {exc.msg}") from exc
    return value(tree)


class CalculatorTool(BaseTool):
    """``{"expression": "3 * (4 + 5)"}`` → ``27``."""

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return 'error: expected {"expression": "<arithmetic>"}', 0.0, {}
        try:
            result = evaluate_arithmetic(expression)
        except (ValueError, ZeroDivisionError, OverflowError) as exc:
            return f"error: {exc}", 0.0, {}
        if isinstance(result, float) and result.is_integer():
            result = int(result)
        return str(result), 0.0, {}


def _limits(cpu_time_s: int, memory_bytes: int):
    def apply() -> None:  # in the child, before exec (nothing imported here: a forked child must not import)
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_time_s, cpu_time_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))

    return apply


class PythonTool(BaseTool):
    """``{"code": "print(6 * 7)"}`` → its stdout, in a limited subprocess (module docstring). ``config``:
    ``cpu_time_s`` (5), ``wall_time_s`` (10), ``memory_mb`` (512), ``max_output_chars`` (2000)."""

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None) -> None:
        super().__init__(config, tool_schema)
        c = self.config
        self.cpu_time_s = int(c.get("cpu_time_s", 5))
        self.wall_time_s = float(c.get("wall_time_s", 10))
        self.memory_bytes = int(c.get("memory_mb", 512)) * 2**20
        self.max_output_chars = int(c.get("max_output_chars", 2000))

    def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'error: expected {"code": "<python source>"}', 0.0, {}
        with tempfile.TemporaryDirectory(prefix="megatron-dapo-python-tool-") as workdir:
            try:
                proc = subprocess.run(
                    [sys.executable, "-I", "-c", code],
                    cwd=workdir,
                    env={"PATH": os.defpath},
                    capture_output=True,
                    text=True,
                    timeout=self.wall_time_s,
                    preexec_fn=_limits(self.cpu_time_s, self.memory_bytes),
                )
            except subprocess.TimeoutExpired:
                return f"error: the code ran longer than {self.wall_time_s:g} s", 0.0, {"timeout": 1.0}
        out = proc.stdout
        if proc.returncode != 0:
            why = f"exit status {proc.returncode}" if proc.returncode > 0 else f"killed by signal {-proc.returncode}"
            out = f"{out}error ({why}): {proc.stderr.strip()[-self.max_output_chars // 2 :]}"
        if len(out) > self.max_output_chars:
            out = out[: self.max_output_chars] + f"... [{len(out) - self.max_output_chars} characters cut]"
        return out, 0.0, {"returncode": float(proc.returncode)}
