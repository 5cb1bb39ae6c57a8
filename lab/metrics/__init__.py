"""Metrics: vLLM-defined latency/throughput summaries, result files and the printed table."""

from lab.metrics.summary import summarize

__all__ = ["summarize"]
