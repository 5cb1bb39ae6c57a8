"""The engine's own loop, and the in-process client the HTTP app talks to.

`EngineLoop` owns one Engine and is the only code that touches it: it takes commands (add, abort,
shutdown) from a thread-safe inbox, steps the engine while it has work, and after every step emits each
request's new tokens as `RequestOutput`s plus an `EngineStats` snapshot. The same loop runs on a thread
(`ThreadEngineClient`, here) or in a replica process (replicas.py).

`EngineClient` is what the app sees: `add_request(request, queue)` delivers that request's outputs to its
asyncio queue; `abort_request` frees its KV. Ignores: HTTP, tokenization, text.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from lab.engines.base import Engine
from lab.errors import LabError
from lab.kv_cache.counters import PrefixCacheCounters
from lab.request import Request, RequestStatus
from lab.sample.logprobs import TokenLogprobs
from lab.spec.counters import SpecCounters

log = logging.getLogger("lab.serve")

FINISH_REASONS = {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                  RequestStatus.FINISHED_ABORTED: "abort"}


@dataclass(slots=True)
class RequestOutput:
    """What one step did for one request: its new token ids and, once it ended, why."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None     # "stop" | "length" | "abort" | "error"; None while running
    error: str | None = None
    is_invalid: bool = False             # the engine refused the request (LabError): a 4xx, not a 5xx
    new_logprobs: list[TokenLogprobs] | None = None   # one per new token, for a request that asked for logprobs
    # NOTE: with a request's first tokens, for one that asked for prompt logprobs (the first prompt token's is None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    kv_reserved_bytes: int = 0
    kv_used_bytes: int = 0
    kv_cache_usage: float | None = None   # vLLM's kv_cache_usage_perc (0-1); None without a fixed KV pool
    num_steps: int = 0
    spec: SpecCounters | None = None   # a speculative engine's cumulative draft / acceptance counts; else None
    prefix_cache: PrefixCacheCounters | None = None   # a paged KV cache's cumulative prefix lookups; else None


@dataclass(slots=True)
class AddRequest:
    request: Request


@dataclass(slots=True)
class AbortRequest:
    request_id: str
    reason: str = "aborted by the client"


@dataclass(slots=True)
class Shutdown:
    drain: bool = True      # finish what is in flight first (False: abort it)


Command = AddRequest | AbortRequest | Shutdown
Emit = Callable[[list[RequestOutput], EngineStats], None]


@dataclass(slots=True)
class _Tracked:
    request: Request
    num_sent: int = 0               # output tokens already emitted
    is_abort_pending: bool = False  # the engine could not abort it running: drop its outputs when it ends


class EngineLoop:
    def __init__(self, engine: Engine, emit: Emit, inbox: "queue.Queue[Command] | None" = None,
                 idle_poll_s: float = 0.5, sync: Callable[[list[Command]], list[Command]] | None = None,
                 is_leader: bool = True) -> None:
        self.engine = engine
        self.emit = emit
        self.sync = sync              # tensor parallel: rank 0's commands to every rank
        self.is_leader = is_leader    # False: a follower rank that only applies what `sync` hands it
        self.inbox: queue.Queue[Command] = inbox if inbox is not None else queue.Queue()
        self.idle_poll_s = idle_poll_s
        self.tracked: dict[str, _Tracked] = {}
        self.stats = EngineStats()
        self._shutdown: Shutdown | None = None
        self._warned_abort = False

    # -- commands --------------------------------------------------------------------------------
    def _handle(self, command: Command, outputs: list[RequestOutput]) -> None:
        if isinstance(command, Shutdown):
            self._shutdown = command
        elif isinstance(command, AddRequest):
            request = command.request
            try:
                self.engine.add_request(request)
            except LabError as exc:
                outputs.append(RequestOutput(request.request_id, [], "error", exc.one_line, is_invalid=True))
                return
            except Exception as exc:  # noqa: BLE001 - a request the engine refuses fails alone
                outputs.append(RequestOutput(request.request_id, [], "error", f"{type(exc).__name__}: {exc}"))
                return
            self.tracked[request.request_id] = _Tracked(request)
        else:
            self._abort(command, outputs)

    def _abort(self, command: AbortRequest, outputs: list[RequestOutput]) -> None:
        tracked = self.tracked.get(command.request_id)
        if tracked is None:
            return  # already finished
        try:
            found = self.engine.abort_request(command.request_id, command.reason)
        except NotImplementedError:
            # NOTE: this engine cannot release a running request; it runs to its end and is dropped then.
            if not self._warned_abort:
                log.warning("engine %s cannot abort requests: aborted ones run to their end (KV held until then)",
                            self.engine.name)
                self._warned_abort = True
            tracked.is_abort_pending = True
            return
        if found is not None:
            self._forget(command.request_id)
            outputs.append(RequestOutput(command.request_id, [], "abort", command.reason))

    def _next_commands(self, block: bool) -> list[Command]:
        """Everything in the inbox (waiting up to idle_poll_s for the first when idle), then `sync`: under
        tensor parallelism every rank applies rank 0's commands in the same iteration (lockstep)."""
        commands: list[Command] = []
        if self.is_leader:
            try:
                commands.append(self.inbox.get(timeout=self.idle_poll_s) if block else self.inbox.get_nowait())
                while True:
                    commands.append(self.inbox.get_nowait())
            except queue.Empty:
                pass
        return self.sync(commands) if self.sync is not None else commands

    # -- stepping ---------------------------------------------------------------------------------
    def _forget(self, request_id: str) -> None:
        self.tracked.pop(request_id, None)
        # NOTE: Engine.run releases per-request state at its end; a server never ends, so release it here.
        self.engine.release_request_state(request_id)

    def _step(self, outputs: list[RequestOutput]) -> None:
        try:
            self.engine.step()
        except Exception as exc:  # noqa: BLE001 - one bad step fails the requests in it, not the server
            log.exception("engine step failed")
            for request in self.engine.abort_running(f"{type(exc).__name__}: {exc}"):
                request.error = request.error or "engine step failed"
        for request_id, tracked in list(self.tracked.items()):
            request = tracked.request
            num_tokens = len(request.output_token_ids)
            if num_tokens == tracked.num_sent and not request.is_finished:
                continue
            new_token_ids = request.output_token_ids[tracked.num_sent:num_tokens]
            new_logprobs = (request.output_logprobs[tracked.num_sent:num_tokens]
                            if request.sampling_params.logprobs is not None else None)
            prompt_logprobs = (list(request.prompt_logprobs or [None]) if tracked.num_sent == 0 and num_tokens
                               and request.sampling_params.prompt_logprobs is not None else None)
            tracked.num_sent = num_tokens
            if not request.is_finished:
                outputs.append(RequestOutput(request_id, new_token_ids, new_logprobs=new_logprobs,
                                             prompt_logprobs=prompt_logprobs))
                continue
            self._forget(request_id)
            if tracked.is_abort_pending:
                continue
            reason = FINISH_REASONS[request.status]
            error = request.error
            outputs.append(RequestOutput(request_id, new_token_ids, "error" if error else reason, error,
                                         new_logprobs=new_logprobs, prompt_logprobs=prompt_logprobs))

    def _num_engine_waiting(self) -> int:
        # NOTE: continuous-batching engines queue in their scheduler, the others in Engine.waiting.
        scheduler = getattr(self.engine, "scheduler", None)
        return len(getattr(scheduler, "waiting", self.engine.waiting))

    def _update_stats(self) -> None:
        num_engine_waiting = self._num_engine_waiting()
        reserved, used = self.engine.kv_usage()
        spec_counters = getattr(self.engine, "spec_counters", None)   # NOTE: speculative engines only
        # NOTE: engines on the paged KV cache only (cb_paged, speculative, ...)
        prefix_counters = getattr(getattr(self.engine, "kv_manager", None), "prefix_cache_counters", None)
        self.stats = EngineStats(num_running=max(0, len(self.tracked) - num_engine_waiting),
                                 num_waiting=num_engine_waiting + self.inbox.qsize(), kv_reserved_bytes=reserved,
                                 kv_used_bytes=used, kv_cache_usage=self.engine.kv_cache_usage(),
                                 num_steps=self.stats.num_steps + 1,
                                 spec=spec_counters() if spec_counters is not None else None,
                                 prefix_cache=prefix_counters() if prefix_counters is not None else None)

    def run(self) -> None:
        """Serve commands until a Shutdown: drain what is in flight first, or abort it and stop at once."""
        while True:
            outputs: list[RequestOutput] = []
            busy = self.engine.has_unfinished_requests()
            for command in self._next_commands(block=not busy and self._shutdown is None):
                self._handle(command, outputs)
            if self._shutdown is not None and not self._shutdown.drain:
                # NOTE: requests the engine cannot abort are answered anyway: the engine is going away.
                outputs += self._abort_all("server shutting down")
                self._update_stats()
                self.emit(outputs, self.stats)
                return
            if self.engine.has_unfinished_requests():
                self._step(outputs)
            self._update_stats()
            if outputs or busy:
                self.emit(outputs, self.stats)
            if self._shutdown is not None and not self.engine.has_unfinished_requests():
                return

    def _abort_all(self, reason: str) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for request_id in list(self.tracked):
            self._abort(AbortRequest(request_id, reason), outputs)
        for request_id in list(self.tracked):   # the ones the engine could not release
            self._forget(request_id)
            outputs.append(RequestOutput(request_id, [], "abort", reason))
        return outputs


class EngineClient(Protocol):
    """What the HTTP app needs from one engine or a set of replicas."""

    max_model_len: int

    def start(self, loop: asyncio.AbstractEventLoop) -> None: ...
    def validate(self, request: Request) -> None: ...
    def add_request(self, request: Request, sink: "asyncio.Queue[RequestOutput]") -> None: ...
    def abort_request(self, request_id: str) -> None: ...
    def stats(self) -> EngineStats: ...
    def shutdown(self, drain: bool, timeout_s: float) -> None: ...


@dataclass
class Sinks:
    """request id -> the asyncio queue its outputs go to; delivery happens on the event loop's thread."""

    loop: asyncio.AbstractEventLoop | None = None
    queues: dict[str, "asyncio.Queue[RequestOutput]"] = field(default_factory=dict)

    def deliver(self, outputs: list[RequestOutput]) -> None:
        """Called from any thread: one hop onto the event loop per step, not one per token."""
        if outputs and self.loop is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.put, outputs)

    def put(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            sink = self.queues.pop(output.request_id, None) if output.is_finished else \
                self.queues.get(output.request_id)
            if sink is not None:
                sink.put_nowait(output)


class ThreadEngineClient:
    """One engine stepped by a dedicated thread in this process."""

    def __init__(self, engine: Engine, sync: Callable[[list[Command]], list[Command]] | None = None) -> None:
        self.engine = engine
        self.max_model_len = engine.runner.max_model_len
        self.sinks = Sinks()
        self._stats = EngineStats()
        self.loop = EngineLoop(engine, self._emit, sync=sync)
        self.thread = threading.Thread(target=self.loop.run, name="engine-loop", daemon=True)

    def _emit(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        self.sinks.deliver(outputs)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.sinks.loop = loop
        self.thread.start()

    def validate(self, request: Request) -> None:
        """The engine's own checks (LabError), run before admission so a bad request is a 4xx."""
        self.engine.validate(request)

    def add_request(self, request: Request, sink: "asyncio.Queue[RequestOutput]") -> None:
        self.sinks.queues[request.request_id] = sink
        self.loop.inbox.put(AddRequest(request))

    def abort_request(self, request_id: str) -> None:
        self.sinks.queues.pop(request_id, None)
        self.loop.inbox.put(AbortRequest(request_id))

    def stats(self) -> EngineStats:
        return self._stats

    def shutdown(self, drain: bool, timeout_s: float) -> None:
        self.loop.inbox.put(Shutdown(drain=drain))
        self.thread.join(timeout_s)
        if self.thread.is_alive() and drain:
            self.loop.inbox.put(Shutdown(drain=False))
            self.thread.join(timeout_s)
        self.sinks.loop = None
