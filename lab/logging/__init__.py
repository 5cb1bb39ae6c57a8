"""Experiment loggers: NullLogger here (logger=none); W&B comes with the measurement suite."""

from lab.logging.null import NullLogger

__all__ = ["NullLogger"]
