"""Micro-benchmark: one draft at batch 1 on SmolLM2-135M, with the drafter's and the draft head's weights
streamed in fp32, as fp16 copies, as Q8_0 blocks (`engine.proposer.weights`; on AMX tiles where the target
runs on them) and, on a CPU with AVX-512 VNNI, as Q8_0 blocks in 8-bit integer products (`int8`): EAGLE
(`EagleProposer.propose`, k = 1 by default) or DFlash (`DFlashProposer.propose`: one block forward, k of its
drafts read out).

A draft first catches the drafter up over the tokens the target accepted since the last one (`--new`: 1
after a plain step, 2-5 after a verify, more when suffix decoding drafted meanwhile), then reads the draft
head. Between two drafts the target's forward streams ~540 MB, so every call here follows a sweep over a
128 MB buffer: the weights come from DRAM, as in the engine. The variants take turns call by call (ABC, then
CBA), so a machine whose speed drifts slows them alike; the ratios are fp32 time / each variant's in the same
run. `--profile` prints where the fp16 draft's time goes (torch.profiler, by op).

    python experiments/bench_drafter.py --new 1,3,8
    python experiments/bench_drafter.py --drafter dflash --k 7 --new 2 --profile
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from lab.kv_cache import PagedKVCacheManager
from lab.models import native_head
from lab.models.sources import smollm2
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.spec.dflash import DFlashProposerConfig
from lab.spec.eagle import EagleProposerConfig
from lab.spec.feature_proposer import FeatureProposer, resolve_draft_weights

CONTEXT = 150      # tokens of context before the first draft


def _request(proposer: FeatureProposer, features: torch.Tensor, request_id: str) -> Request:
    request = Request(request_id, list(range(100, 100 + CONTEXT)), SamplingParams(max_tokens=100_000))
    proposer.store.kv.allocate_slots(request, CONTEXT)                 # NOTE: the blocks the features live in
    proposer.store.write(request_id, 0, features[:CONTEXT - 1])
    request.num_computed_tokens = CONTEXT - 1
    return request


def _advance(proposer: FeatureProposer, request: Request, features: torch.Tensor, num_new: int) -> None:
    """The target accepted `num_new` more tokens (their features are known up to the last one)."""
    for _ in range(num_new):
        request.output_token_ids.append(100 + request.num_tokens % 200)
    start, end = request.num_computed_tokens, request.num_tokens - 1
    proposer.store.kv.allocate_slots(request, request.num_tokens - start)
    proposer.store.write(request.request_id, start, features[start:end])   # NOTE: only the new rows, as the engine does
    request.num_computed_tokens = end


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--new", default="1,3,8", help="comma-separated tokens accepted between two drafts")
    parser.add_argument("--calls", type=int, default=40, help="timed drafts per variant and setting")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--drafter", choices=("eagle", "dflash"), default="eagle")
    parser.add_argument("--checkpoint", default=None, help="the drafter's checkpoint (default: the committed one)")
    parser.add_argument("--k", type=int, default=1, help="drafts per call")
    parser.add_argument("--profile", action="store_true", help="also profile 20 fp16 drafts by op")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(smollm2(), dtype="float32", device="cpu")
    config_cls = EagleProposerConfig if args.drafter == "eagle" else DFlashProposerConfig
    checkpoint = {"checkpoint": args.checkpoint} if args.checkpoint else {}
    kinds = ("fp32", "fp16", "q8_0") + (("int8",) if native_head.supported() else ())
    variants = {weights: config_cls(weights=weights, **checkpoint).build(
        runner, PagedKVCacheManager(num_blocks=512, block_size=16, enable_prefix_caching=False))
                for weights in kinds}
    width = runner.config.hidden_size * len(variants["fp16"].drafter.feature_layers)
    features = torch.randn(CONTEXT + 40 * args.calls, width)
    flush = torch.ones(32 * 2**20)
    tiles = resolve_draft_weights("auto", runner) == "q8_0"          # NOTE: the target runs on AMX tiles
    labels = {"fp32": "fp32 weights", "fp16": "fp16", "q8_0": "Q8_0 blocks" + " (AMX tiles)" * tiles,
              "int8": "int8 products"}
    print(f"# bench_drafter: {args.drafter} k={args.k} at batch 1, {args.threads} thread(s), context {CONTEXT}+, "
          f"load average {os.getloadavg()[0]:.2f}")
    print("| tokens caught up | " + " | ".join(f"{labels[k]} (ms)" for k in kinds) + " | "
          + " | ".join(f"fp32 / {k}" for k in kinds[1:]) + " |")
    print("|---:|" + "---:|" * (2 * len(kinds) - 1))
    for num_new in (int(n) for n in args.new.split(",")):
        requests = {name: _request(p, features, f"r{num_new}") for name, p in variants.items()}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for call in range(args.calls + 2):
            order = list(variants) if call % 2 == 0 else list(reversed(variants))
            for name in order:
                proposer, request = variants[name], requests[name]
                _advance(proposer, request, features, num_new)
                flush.mul_(1.0)                                  # evict the drafter from the caches
                start = time.perf_counter()
                draft = proposer.propose([request], args.k, [None])
                if call >= 2:                                    # NOTE: the first two calls warm up
                    times[name].append(time.perf_counter() - start)
                assert draft[request.request_id].token_ids, "the benchmark request was not drafted"
        ms = {k: 1e3 * statistics.median(times[k]) for k in kinds}
        print(f"| {num_new} | " + " | ".join(f"{ms[k]:.2f}" for k in kinds) + " | "
              + " | ".join(f"{ms['fp32'] / ms[k]:.2f}x" for k in kinds[1:]) + " |")
    if args.profile:
        proposer, request = variants["fp16"], requests["fp16"]
        with torch.profiler.profile() as prof:
            for _ in range(20):
                _advance(proposer, request, features, num_new)
                proposer.propose([request], args.k, [None])
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


if __name__ == "__main__":
    main()
