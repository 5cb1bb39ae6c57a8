"""NullLogger: the experiment-logger interface that does nothing (logger=none)."""

from __future__ import annotations

from typing import Any


class NullLogger:
    def __init__(self, **_: Any) -> None:
        pass

    def log_summary(self, metrics: dict[str, Any]) -> None:
        pass

    def log_table(self, name: str, rows: list[dict[str, Any]]) -> None:
        pass

    def finish(self, exit_code: int = 0) -> None:
        pass
