"""lab: an LLM inference engine built from first principles, and the experiments around it."""

__version__ = "0.1.0"
