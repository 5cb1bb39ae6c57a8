"""Experiment loggers: NullLogger (logger=none) and WandbLogger (logger=wandb), one interface.

WandbLogger is imported on first use so `import lab.logging` does not pull in wandb.
"""

from typing import Any

from lab.logging.null import NullLogger

__all__ = ["NullLogger", "WandbLogger"]


def __getattr__(name: str) -> Any:
    if name == "WandbLogger":
        from lab.logging.wandb_logger import WandbLogger

        return WandbLogger
    raise AttributeError(f"module 'lab.logging' has no attribute {name!r}")
