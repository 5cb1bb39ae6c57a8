"""`serve.replicas=N`: N engine processes (one per GPU on CUDA; on CPU each pinned to its own cores)
behind a router that picks a replica per request: round-robin or least-outstanding-requests.

Each replica process runs the same EngineLoop as the in-process client, fed by a multiprocessing queue;
its outputs come back on another queue, read by a thread here and handed to the event loop.
Owns: the processes, pinning, routing, and which replica holds which request. Ignores: HTTP.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lab.engines.base import Engine
from lab.errors import LabError
from lab.kv_cache.counters import PrefixCacheCounters
from lab.request import Request
from lab.serve.engine_loop import AbortRequest, AddRequest, EngineLoop, EngineStats, RequestOutput, Shutdown, Sinks

log = logging.getLogger("lab.serve")
ROUTERS = ("round_robin", "least_outstanding")
EngineFactory = Callable[[int], Engine]   # replica index -> engine (picklable: it crosses into a new process)


def split_cpus(num_replicas: int, cpus: list[int] | None = None) -> list[list[int]]:
    """Contiguous, disjoint core sets, one per replica (shared round-robin when replicas outnumber cores)."""
    cpus = sorted(os.sched_getaffinity(0)) if cpus is None else cpus
    if num_replicas > len(cpus):
        return [[cpus[i % len(cpus)]] for i in range(num_replicas)]
    size = len(cpus) // num_replicas
    return [cpus[i * size:(i + 1) * size] for i in range(num_replicas)]


@dataclass(slots=True)
class ReplicaInfo:
    max_model_len: int
    pid: int
    cpus: list[int] | None


def replica_main(index: int, factory: EngineFactory, cpus: list[int] | None, inbox: Any, outbox: Any) -> None:
    """A replica process: pin, build the engine, report ready, then run the engine loop until Shutdown."""
    import torch

    if cpus is not None:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    try:
        engine = factory(index)
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the launch
        outbox.put(("failed", f"{type(exc).__name__}: {exc}"))
        return
    outbox.put(("ready", ReplicaInfo(engine.runner.max_model_len, os.getpid(), cpus)))
    EngineLoop(engine, lambda outputs, stats: outbox.put(("outputs", (outputs, stats))), inbox=inbox).run()
    outbox.put(("exited", None))


class ProcessReplica:
    def __init__(self, index: int, factory: EngineFactory, cpus: list[int] | None) -> None:
        ctx = mp.get_context("spawn")  # NOTE: fork after torch has started threads can deadlock
        self.index = index
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=replica_main, args=(index, factory, cpus, self.inbox, self.outbox),
                                   name=f"lab-replica-{index}", daemon=True)
        self.sinks = Sinks()
        self.num_requests = 0       # routed here so far
        self.info: ReplicaInfo | None = None
        self._stats = EngineStats()
        self.reader = threading.Thread(target=self._read, name=f"replica-{index}-reader", daemon=True)

    @property
    def num_outstanding(self) -> int:
        return len(self.sinks.queues)

    def launch(self) -> None:
        self.process.start()

    def wait_ready(self, timeout_s: float) -> ReplicaInfo:
        try:
            kind, payload = self.outbox.get(timeout=timeout_s)
        except queue.Empty:
            raise LabError(f"replica {self.index} did not start within {timeout_s:.0f} s") from None
        if kind != "ready":
            raise LabError(f"replica {self.index} failed to start: {payload}")
        self.info = payload
        self.reader.start()
        return payload

    def _read(self) -> None:
        while True:
            try:
                kind, payload = self.outbox.get(timeout=1.0)
            except queue.Empty:
                if self.process.is_alive():
                    continue
                kind = "died"
            except (EOFError, OSError):
                kind = "died"
            if kind != "outputs":
                break
            outputs, self._stats = payload
            self.sinks.deliver(outputs)
        if self.sinks.loop is not None and not self.sinks.loop.is_closed():
            self.sinks.loop.call_soon_threadsafe(self._fail_outstanding)

    def _fail_outstanding(self) -> None:
        """On the event loop: a replica that is gone answers its remaining requests with an error."""
        self.sinks.put([RequestOutput(rid, [], "error", f"replica {self.index} exited")
                         for rid in list(self.sinks.queues)])

    def add_request(self, request: Request, sink: "asyncio.Queue[RequestOutput]") -> None:
        self.sinks.queues[request.request_id] = sink
        self.num_requests += 1
        self.inbox.put(AddRequest(request))

    def abort_request(self, request_id: str) -> None:
        self.sinks.queues.pop(request_id, None)
        self.inbox.put(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def request_shutdown(self, drain: bool) -> None:
        if self.process.is_alive():
            self.inbox.put(Shutdown(drain=drain))

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)
        if self.process.is_alive():
            log.warning("replica %d did not stop within %.0f s; terminating it", self.index, timeout_s)
            self.process.terminate()
            self.process.join(5)
        if self.reader.is_alive():
            self.reader.join(2)


class ReplicaRouter:
    """An EngineClient over N replica processes."""

    def __init__(self, factory: EngineFactory, num_replicas: int, router: str = "least_outstanding",
                 pin_cpus: bool = True) -> None:
        if router not in ROUTERS:
            raise LabError(f"serve.router={router!r} is unknown", f"use one of {', '.join(ROUTERS)}")
        if num_replicas < 1:
            raise LabError(f"serve.replicas must be >= 1, got {num_replicas}", "set serve.replicas=1 or more")
        cpu_sets = split_cpus(num_replicas) if pin_cpus else [None] * num_replicas
        self.replicas = [ProcessReplica(i, factory, cpus) for i, cpus in enumerate(cpu_sets)]
        self.router = router
        self.owner: dict[str, ProcessReplica] = {}
        self._next = 0
        self.max_model_len = 0

    def launch(self, timeout_s: float = 600.0) -> list[ReplicaInfo]:
        """Start every replica and wait until all have built their engines (loading in parallel)."""
        for replica in self.replicas:
            replica.launch()
        try:
            infos = [replica.wait_ready(timeout_s) for replica in self.replicas]
        except LabError:
            self.shutdown(drain=False, timeout_s=5)
            raise
        self.max_model_len = min(info.max_model_len for info in infos)
        return infos

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        for replica in self.replicas:
            replica.sinks.loop = loop

    def validate(self, request: Request) -> None:
        """Nothing to check here: each replica's engine validates in its own process."""

    def pick(self) -> ProcessReplica:
        n = len(self.replicas)
        order = [self.replicas[(self._next + i) % n] for i in range(n)]
        self._next = (self._next + 1) % n
        if self.router == "round_robin":
            return order[0]
        return min(order, key=lambda r: r.num_outstanding)   # ties go round-robin

    def add_request(self, request: Request, sink: "asyncio.Queue[RequestOutput]") -> None:
        replica = self.pick()
        # NOTE: owners of finished requests are dropped lazily (here and on abort) to stay O(1) per request.
        if len(self.owner) > 4 * sum(r.num_outstanding for r in self.replicas) + 1024:
            self.owner = {rid: r for rid, r in self.owner.items() if rid in r.sinks.queues}
        self.owner[request.request_id] = replica
        replica.add_request(request, sink)

    def abort_request(self, request_id: str) -> None:
        replica = self.owner.pop(request_id, None)
        if replica is not None:
            replica.abort_request(request_id)

    def stats(self) -> EngineStats:
        total = EngineStats()
        for replica in self.replicas:
            s = replica.stats()
            total.num_running += s.num_running
            total.num_waiting += s.num_waiting
            total.kv_reserved_bytes += s.kv_reserved_bytes
            total.kv_used_bytes += s.kv_used_bytes
            if s.kv_cache_usage is not None:   # NOTE: replicas' pools are the same size: the mean is the pooled share
                total.kv_cache_usage = (total.kv_cache_usage or 0.0) + s.kv_cache_usage / len(self.replicas)
            total.num_steps += s.num_steps
            if s.spec is not None:
                total.spec = s.spec if total.spec is None else total.spec + s.spec
            if s.prefix_cache is not None:
                total.prefix_cache = s.prefix_cache + (total.prefix_cache or PrefixCacheCounters())
        return total

    def replica_loads(self) -> list[int]:
        return [r.num_outstanding for r in self.replicas]

    def shutdown(self, drain: bool, timeout_s: float) -> None:
        for replica in self.replicas:
            replica.request_shutdown(drain)
        for replica in self.replicas:
            if replica.process.pid is not None:
                replica.join(timeout_s)
