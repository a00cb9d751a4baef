"""A turn's time budget: how long each stage took, for spans and for `Server-Timing`.

I/O-free. Stages are recorded in the order they run; a stage recorded twice (a retried
leg) adds up. The header form is the W3C Server-Timing syntax (`name;dur=ms`), which
stock HTTP clients ignore and benchmarks parse with `parse_server_timing`.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

#: The stages a turn can have, in order. Those up to `decode` end before the response
#: headers (so they fit the header); `first_token` and `finalize` only reach the span.
STAGES = ("receive", "tokenize", "plan", "prefill", "decode", "first_token", "finalize")
HEADER = "Server-Timing"
_PART = re.compile(r"^\s*([!#$%&'*+.^_`|~0-9A-Za-z-]+)(.*)$")
_DUR = re.compile(r";\s*dur=([0-9.]+)")


@dataclass
class TurnBudget:
    """Seconds per stage of one turn; `arrived` is the perf_counter at the request's arrival."""

    arrived: float = field(default_factory=time.perf_counter)
    stages: dict[str, float] = field(default_factory=dict)

    def add(self, stage: str, seconds: float) -> None:
        if stage not in STAGES:
            raise ValueError(f"unknown stage {stage!r}")
        self.stages[stage] = self.stages.get(stage, 0.0) + max(0.0, seconds)

    def add_remainder(self, stage: str, now: float) -> None:
        """Record as `stage` the time since arrival that no earlier stage counted."""
        counted = sum(v for k, v in self.stages.items() if k != "finalize")
        self.add(stage, now - self.arrived - counted)

    def since_arrival(self, now: float | None = None) -> float:
        return (time.perf_counter() if now is None else now) - self.arrived

    def server_timing(self, now: float | None = None) -> str:
        """`receive;dur=0.41, ..., total;dur=12.3` (ms): the stages so far and the time
        since arrival."""
        parts = [f"{s};dur={self.stages[s] * 1000:.2f}" for s in STAGES if s in self.stages]
        parts.append(f"total;dur={self.since_arrival(now) * 1000:.2f}")
        return ", ".join(parts)

    def record(self, span: Any) -> None:
        """The stages as span attributes `kvagent.stage.<name>_ms`."""
        if span is None:
            return
        for stage, seconds in self.stages.items():
            span.set_attribute(f"kvagent.stage.{stage}_ms", round(seconds * 1000, 3))


def parse_server_timing(value: str | None) -> dict[str, float]:
    """Metric name -> duration in seconds, for the metrics that carry `dur`."""
    out: dict[str, float] = {}
    for part in (value or "").split(","):
        m = _PART.match(part)
        if m is None:
            continue
        dur = _DUR.search(m.group(2))
        if dur is not None:
            out[m.group(1)] = float(dur.group(1)) / 1000
    return out
