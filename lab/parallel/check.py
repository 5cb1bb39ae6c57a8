"""`torchrun --nproc-per-node N -m lab.parallel.check [--out result.json]`: tensor-parallel output equals
single-device output on the tiny model. Every rank builds the same weights; rank 0 first computes the
unsharded references (logits, `ar` greedy tokens, `cb_paged` greedy tokens); then every rank shards and
the same runs repeat: prefill logits through the sharded model, `ar`, and `cb_paged` driven by the
lockstep engine loop the server uses (rank 0 broadcasting its commands). Rank 0 writes the comparison.
Exit status 0 when greedy tokens match exactly and logits agree to 1e-4.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from lab.engines.ar import AREngine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.kv_cache import NoCache, PagedKVCacheConfig
from lab.models.sources import tiny
from lab.parallel.distributed import destroy, init_distributed
from lab.parallel.serving import CommandBroadcast
from lab.parallel.shard import shard_runner
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.serve.engine_loop import AddRequest, EngineLoop, RequestOutput, Shutdown

PROMPTS = [[5, 17, 42, 99, 3], [7, 8, 9], [120, 1, 64, 33, 2, 90, 11, 4], [30] * 12]


def requests(max_tokens: int, sampled: bool = False) -> list[Request]:
    params = dict(temperature=0.8, top_p=0.9) if sampled else {}
    return [Request(f"{'s' if sampled else 'g'}{i}", list(p), SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                                             **params))
            for i, p in enumerate(PROMPTS)]


def prefill_logits(runner: ModelRunner) -> torch.Tensor:
    return runner.execute(torch.tensor([PROMPTS[2]]), torch.arange(len(PROMPTS[2]))[None], NoCache(),
                          logits_index=None)                                            # (1, T, V)


def cb_paged(runner: ModelRunner) -> ContinuousBatchingEngine:
    return ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
                                    PagedKVCacheConfig(block_size=4, num_blocks=64, enable_prefix_caching=False))


def tokens(engine_requests: list[Request]) -> list[list[int]]:
    return [r.output_token_ids for r in engine_requests]


def lockstep(engine: ContinuousBatchingEngine, ctx: Any, max_tokens: int) -> dict[str, list[int]]:
    """The serving loop: rank 0 feeds greedy and sampled requests, every rank steps in lockstep."""
    collected: dict[str, list[int]] = {}

    def emit(outputs: list[RequestOutput], _: Any) -> None:
        for output in outputs:
            collected.setdefault(output.request_id, []).extend(output.new_token_ids)

    loop = EngineLoop(engine, emit, sync=CommandBroadcast(ctx), is_leader=ctx.is_leader)
    if ctx.is_leader:
        for request in requests(max_tokens) + requests(max_tokens, sampled=True):
            loop.inbox.put(AddRequest(request))
        loop.inbox.put(Shutdown(drain=True))
    loop.run()
    return collected


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--vocab-size", type=int, default=127, help="odd on purpose: the last vocab shard is padded")
    parser.add_argument("--tie", action="store_true", help="tied embedding and head")
    parser.add_argument("--gguf-blocks", action="store_true",
                        help="weights made of GGUF blocks, so every shard streams its blocks (weight_blocks)")
    parser.add_argument("--max-tokens", type=int, default=12)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    ctx = init_distributed()
    torch.manual_seed(0)
    source = tiny(seed=0, vocab_size=args.vocab_size, with_tokenizer=False, tie_word_embeddings=args.tie,
                  gguf_blocks=args.gguf_blocks)
    runner = ModelRunner(source, dtype="float32", device="cuda" if torch.cuda.is_available() else "cpu")
    if ctx.is_leader:
        ref = {"logits": prefill_logits(runner), "ar": tokens(AREngine(runner).run(requests(args.max_tokens)).requests),
               "cb_paged": tokens(cb_paged(runner).run(requests(args.max_tokens)).requests)}
    shard_runner(runner)
    logits = prefill_logits(runner)
    ar = tokens(AREngine(runner).run(requests(args.max_tokens)).requests)
    served = lockstep(cb_paged(runner), ctx, args.max_tokens)
    status = 0
    if ctx.is_leader:
        result = {"world_size": ctx.world_size, "max_abs_logit_diff": float((logits - ref["logits"]).abs().max()),
                  "ar_equal": ar == ref["ar"], "cb_paged_equal": [served[f"g{i}"] for i in range(len(PROMPTS))]
                  == ref["cb_paged"], "ar_tokens": ar, "reference_ar_tokens": ref["ar"],
                  "sampled_lengths": [len(served[f"s{i}"]) for i in range(len(PROMPTS))],
                  "block_linears": runner.block_linears}
        ok = result["ar_equal"] and result["cb_paged_equal"] and result["max_abs_logit_diff"] < 1e-4 and \
            result["sampled_lengths"] == [args.max_tokens] * len(PROMPTS)
        result["ok"] = ok
        print(json.dumps({k: v for k, v in result.items() if not k.endswith("tokens")}), flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
        status = 0 if ok else 1
    destroy()
    return status


if __name__ == "__main__":
    sys.exit(main())
