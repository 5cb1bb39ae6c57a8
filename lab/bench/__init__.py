"""The serving benchmark client (`lab-bench-serve`): drives any OpenAI-compatible endpoint with a workload's
prompts and arrivals and measures TTFT/TPOT/ITL/E2EL from the stream as vLLM's `bench serve` does.

Modules: client (one streamed request, timed), driver (arrivals, concurrency, warm-ups), metrics (vLLM's
result fields). The Hydra entry point is lab/bench_serve.py.
"""
