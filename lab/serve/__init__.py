"""OpenAI-compatible serving: an HTTP front end (FastAPI) over any engine, stepped in its own loop.

Modules: protocol (request schemas, error bodies), detokenizer (incremental text, stop strings),
engine_loop (the engine's thread / process loop and the clients the app talks to), replicas (engine
processes behind a router), app (routes, admission, streaming), metrics (Prometheus), cli (Hydra entry).
"""
