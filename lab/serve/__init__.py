"""OpenAI-compatible serving: an HTTP front end (FastAPI + uvicorn) over any engine, stepped in its own loop.

Modules: protocol (request schemas, error bodies, response shapes), detokenizer (incremental text, stop
strings), engine_loop (the loop that owns an engine; the in-process client), replicas (engine processes
behind a router), session (one request's stream or answer), app (routes, validation, admission), metrics
(Prometheus), server (uvicorn, foreground or a thread), cli (the Hydra entry point, `lab-serve`).
"""
