"""Structured outputs at batch 1 on SmolLM2: what the grammar costs a plain step, and what speculation gains under
it, with and without drafting the tokens the grammar forces (`engine.grammar_drafts`). Every engine runs the same
requests in turns, in one process; the table prints each one's TPOT (decode only: (last - first token) / (n - 1),
averaged over requests), its ratio to `cb_paged` under the same schema, tau, and whether its greedy tokens equal
that baseline's.

    python experiments/bench_structured.py                 # 8 prompts x 96 tokens, compact JSON, 2 rounds
    python experiments/bench_structured.py --any-whitespace --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

import torch

from lab.engines.base import Engine
from lab.engines.continuous import ContinuousBatchingEngine
from lab.engines.speculative import SpeculativeEngine
from lab.kv_cache import PagedKVCacheConfig
from lab.models.sources import smollm2
from lab.request import Request, SamplingParams
from lab.runner import ModelRunner
from lab.sample.structured import StructuredOutputsParams
from lab.sched import SchedulerConfig
from lab.spec.suffix import SuffixProposerConfig

SCHEMA = {"type": "object", "additionalProperties": False,
          "properties": {"full_name": {"type": "string"}, "age_in_years": {"type": "integer"},
                         "favourite_programming_language": {"type": "string"},
                         "years_of_experience": {"type": "integer"}, "is_currently_employed": {"type": "boolean"}},
          "required": ["full_name", "age_in_years", "favourite_programming_language", "years_of_experience",
                       "is_currently_employed"]}
PEOPLE = ["a Rust developer from Oslo", "a retired teacher", "a data scientist in Lagos", "a student in Kyoto",
          "a game designer", "a nurse who codes in her spare time", "a startup founder", "a kernel hacker"]
KV = PagedKVCacheConfig(block_size=16, num_blocks=512, kv_cache_memory_mb=None)
BATCH_1 = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=512)


def engines(runner: ModelRunner, num_spec_tokens: int) -> dict[str, tuple[Engine, bool]]:
    """name -> (engine, whether its requests carry the schema)."""
    return {"cb_paged, free text": (ContinuousBatchingEngine(runner, BATCH_1, KV), False),
            "cb_paged": (ContinuousBatchingEngine(runner, BATCH_1, KV), True),
            "suffix": (SpeculativeEngine(runner, SuffixProposerConfig(), num_spec_tokens, BATCH_1, KV,
                                         grammar_drafts=False), True),
            "suffix + forced drafts": (SpeculativeEngine(runner, SuffixProposerConfig(), num_spec_tokens, BATCH_1,
                                                         KV, grammar_drafts=True), True)}


def requests(prompts: list[list[int]], max_tokens: int, constraint: StructuredOutputsParams | None) -> list[Request]:
    return [Request(f"r{i}", list(p), SamplingParams(max_tokens=max_tokens, structured_outputs=constraint))
            for i, p in enumerate(prompts)]


def tpot_ms(done: list[Request]) -> float:
    return 1e3 * statistics.mean((r.token_times[-1] - r.token_times[0]) / (len(r.token_times) - 1)
                                 for r in done if len(r.token_times) > 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--num-spec-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--any-whitespace", action="store_true", help="JSON with any whitespace (default: compact)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    runner = ModelRunner(smollm2(), dtype="float32", device="cpu")
    prompts = [runner.tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {p} as JSON."}],
                                                    add_generation_prompt=True, tokenize=False)
               for p in (PEOPLE * args.num_prompts)[:args.num_prompts]]
    prompts = [runner.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    constraint = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=not args.any_whitespace)
    built = engines(runner, args.num_spec_tokens)
    results: dict[str, dict[str, Any]] = {name: {"tpot": []} for name in built}
    for _ in range(args.rounds):
        for name, (engine, constrained) in built.items():
            engine.reset_caches()   # NOTE: suffix decoding learns from earlier outputs; every round starts cold
            engine.reset_stats()
            done = engine.run(requests(prompts, args.max_tokens, constraint if constrained else None)).requests
            results[name]["tpot"].append(tpot_ms(done))
            results[name]["tokens"] = [r.output_token_ids for r in done]
            results[name]["stats"] = engine.stats()
    base = min(results["cb_paged"]["tpot"])
    print(f"SmolLM2-135M fp32, {args.threads} thread(s), batch 1, {args.num_prompts} prompts x {args.max_tokens} "
          f"tokens, {'any-whitespace' if args.any_whitespace else 'compact'} JSON schema, best of {args.rounds}")
    print("| engine | TPOT ms | vs cb_paged (schema) | tau | forced drafts (tokens) | same tokens |")
    print("|---|---:|---:|---:|---:|---|")
    for name, result in results.items():
        stats, tpot = result["stats"], min(result["tpot"])
        tau = stats.get("spec_decode_acceptance_length")
        forced = ("-" if "spec/grammar_forced_drafts" not in stats else
                  f"{stats['spec/grammar_forced_drafts']} ({stats['spec/grammar_forced_draft_tokens']})")
        same = "-" if name.endswith("free text") else str(result["tokens"] == results["cb_paged"]["tokens"])
        print(f"| {name} | {tpot:.2f} | {base / tpot:.2f}x | {'-' if tau is None else f'{tau:.2f}'} | {forced} | "
              f"{same} |")
    print(f"\nfirst output: {runner.tokenizer.decode(results['cb_paged']['tokens'][0], skip_special_tokens=True)!r}")


if __name__ == "__main__":
    main()
