"""How many of a DFlash block's offsets get a training label on recorded answers (ShareGPT's, the bulk of the CPU
corpora), where `drafter.greedy_path` labels offset j only while the text's tokens at offsets 1..j-1 are the
target's own greedy ones. On the target's own answers every offset is labelled, so the ratio is what on-policy
data buys the later offsets per token (docs/speculative.md, "Session 34").

    python experiments/greedy_path_coverage.py --answers 80
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from lab.kv_cache.base import NoCache
from lab.models.sources import smollm2
from lab.runner import ModelRunner
from lab.training.data import DataConfig, Sequence, reference_sequences


def greedy_follows(runner: ModelRunner, sequence: Sequence) -> list[bool]:
    """For each answer token: is it the target's greedy token there (one prefill, argmax against the text)?"""
    ids = torch.tensor(sequence.token_ids)[None]                                           # (1, T)
    greedy = runner.execute(ids, torch.arange(ids.shape[1])[None], NoCache(), None)[0].argmax(-1)   # (T,)
    return (greedy[:-1] == ids[0, 1:])[sequence.prompt_len - 1:].tolist()


def labelled_offsets(follows: list[bool], block_size: int) -> list[int]:
    """Blocks anchored at each answer position whose offset j (1..B-1) is labelled, counted per j."""
    counts = [0] * (block_size - 1)
    for anchor in range(len(follows) - (block_size - 1)):
        run = 0
        while run < block_size - 1 and follows[anchor + run]:
            run += 1
        for j in range(1, block_size):
            counts[j - 1] += run >= j - 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=80, help="recorded ShareGPT answers to read")
    parser.add_argument("--block-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    runner = ModelRunner(smollm2(), dtype="float32", device="cpu")
    with tempfile.TemporaryDirectory() as cache:
        # NOTE: the references the default recipe (num_prompts 320) would add first
        sequences = reference_sequences(runner.tokenizer, DataConfig(num_prompts=320, reference_answers=args.answers),
                                        Path(cache), [])
    counts, blocks, greedy, tokens = [0] * (args.block_size - 1), 0, 0, 0
    for sequence in sequences:
        follows = greedy_follows(runner, sequence)
        greedy, tokens = greedy + sum(follows), tokens + len(follows)
        counts = [a + b for a, b in zip(counts, labelled_offsets(follows, args.block_size))]
        blocks += max(0, len(follows) - (args.block_size - 1))
    print(f"{len(sequences)} recorded answers, {tokens} answer tokens: the target's greedy token "
          f"{100 * greedy / tokens:.1f} % of the time")
    print("| offset | labelled, recorded answers | labelled, the target's own answers |")
    print("|---:|---:|---:|")
    for j, count in enumerate(counts, start=1):
        print(f"| {j} | {100 * count / blocks:.1f} % | 100 % |")


if __name__ == "__main__":
    main()
