"""A user tool that misbehaves, as issue #42's user found: the tool task's ``lookup`` (``tasks/lookup_tool.py``) as a
verl-style class from a file — async methods, no project base class — whose calls raise, block the event loop in
``time.sleep``, answer 200 kB, call ``os._exit`` or allocate 6 GiB.

A call misbehaves as its arguments' ``fault`` says (the tests draw the faults, so they know them), or, without one,
at the rates of ``config["rates"]`` (``{fault: probability}``, drawn per call; ``benchmarks/tool_faults.py``)."""

from __future__ import annotations

import os
import random
import time
from typing import Any, Optional

FAULTS = ("raise", "hang", "huge", "exit", "memory")
HUGE_CHARS = 200_000


class FaultyLookup:
    """``lookup(box)``: the digit in one of the sample's boxes (``create(instance_id, boxes=...)``), or a fault."""

    def __init__(self, config: Optional[dict] = None, tool_schema: Optional[dict] = None) -> None:
        config = dict(config or {})
        self.rates = {str(k): float(v) for k, v in (config.get("rates") or {}).items()}
        self.hang_s = float(config.get("hang_s", 60.0))
        self.rng = random.Random()  # each worker draws its own faults
        self.boxes: dict[str, dict[str, str]] = {}

    async def create(self, instance_id: str, boxes: Optional[dict] = None, **_: Any) -> str:
        self.boxes[instance_id] = {str(k): str(v) for k, v in (boxes or {}).items() if v is not None}
        return instance_id

    async def execute(self, instance_id: str, arguments: dict) -> tuple[str, float, dict]:
        fault = arguments.get("fault") if isinstance(arguments, dict) else None
        fault = self._draw() if fault is None else fault
        if fault == "raise":
            raise RuntimeError("injected fault")
        if fault == "hang":
            time.sleep(self.hang_s)  # blocks the worker's event loop: nothing else there runs meanwhile
        if fault == "exit":
            os._exit(1)
        if fault == "memory":
            return str(len(bytearray(6 * 2**30))), 0.0, {}
        boxes = self.boxes.get(instance_id)
        box = arguments.get("box") if isinstance(arguments, dict) else None
        if boxes is None or box not in boxes:
            return f"error: no box {box}", 0.0, {"found": 0}
        answer = boxes[box] * HUGE_CHARS if fault == "huge" else boxes[box]
        return answer, 0.0, {"found": 1}

    async def release(self, instance_id: str) -> None:
        self.boxes.pop(instance_id, None)

    def _draw(self) -> Optional[str]:
        u, edge = self.rng.random(), 0.0
        for fault, rate in self.rates.items():
            edge += rate
            if u < edge:
                return fault
        return None
