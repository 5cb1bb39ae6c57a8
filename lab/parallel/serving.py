"""Serving under tensor parallelism: every rank runs the same engine loop in lockstep (SPMD, as SGLang's
per-rank schedulers do). Rank 0 serves HTTP and, each loop iteration, broadcasts the commands it received
(add, abort, shutdown) to the other ranks, so every rank's scheduler makes the same decisions and every
forward's collectives pair up. Sampling agrees across ranks because the logits are all-gathered
(identical everywhere) and each sampled request gets an explicit seed from rank 0.

Owns: the command broadcast and the follower ranks' loop. Ignores: HTTP (the app) and sharding (shard.py).
"""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lab.parallel.distributed import ParallelContext, destroy, init_distributed
from lab.serve.engine_loop import AddRequest, Command, EngineLoop, ThreadEngineClient
from lab.serve.replicas import split_cpus


class CommandBroadcast:
    """`sync` for EngineLoop: rank 0's commands, pickled to every rank over the CPU group."""

    def __init__(self, ctx: ParallelContext) -> None:
        self.ctx = ctx
        self.rng = random.Random()

    def __call__(self, commands: list[Command]) -> list[Command]:
        if self.ctx.is_leader:
            for command in commands:
                params = command.request.sampling_params if isinstance(command, AddRequest) else None
                if params is not None and not params.is_greedy and params.seed is None:
                    # NOTE: per-process seeds (hash randomisation) would make ranks sample different tokens.
                    params.seed = self.rng.getrandbits(63)
        box: list[Any] = [commands if self.ctx.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
        return box[0]


def run_follower(ctx: ParallelContext, engine: Any) -> None:
    """A rank > 0: apply rank 0's commands and step until rank 0 broadcasts Shutdown."""
    # NOTE: torchrun signals every rank; only rank 0 decides when to stop, and tells the others.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    EngineLoop(engine, lambda outputs, stats: None, sync=CommandBroadcast(ctx), is_leader=False).run()


def serve_tensor_parallel(cfg: Any, factory: Callable[[int], Any], make_app: Callable[..., Any]) -> None:
    """torchrun entry for `serve.tensor_parallel=N`: build the sharded engine on every rank; rank 0 serves."""
    from lab.serve.server import serve_forever

    ctx = init_distributed(int(cfg.serve.tensor_parallel))
    if not torch.cuda.is_available() and cfg.serve.pin_cpus and ctx.world_size == int(os.environ.get(
            "LOCAL_WORLD_SIZE", ctx.world_size)):
        # NOTE: as replicas are: each rank on its own cores, so ranks do not steal each other's time.
        cpus = split_cpus(ctx.world_size)[ctx.local_rank]
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(int(cfg.threads) if cfg.get("threads") else len(cpus))
    engine = factory(ctx.local_rank)
    try:
        if not ctx.is_leader:
            run_follower(ctx, engine)
            return
        runner = engine.runner
        client = ThreadEngineClient(engine, sync=CommandBroadcast(ctx))
        app = make_app(cfg, client, runner.tokenizer, runner.vocab_size, runner.model_id)
        print(f"[lab-serve] tensor parallel x{ctx.world_size}: serving on http://{cfg.serve.host}:{cfg.serve.port}/v1",
              flush=True)
        serve_forever(app, cfg.serve.host, int(cfg.serve.port), float(cfg.serve.drain_timeout_s), cfg.serve.log_level)
    finally:
        destroy()
