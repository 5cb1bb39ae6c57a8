"""Engines: the step loop of each rung of the ladder (ar_nocache, ar, hf, ...)."""

from lab.engines.base import Engine, RunResult

__all__ = ["Engine", "RunResult"]
