"""Where a DFlash drafter's accepted tokens come from: top-1 agreement with the target at every block offset,
and the share of blocks whose first j drafts are all right (greedy acceptance reaches j + 1), on the
held-out answers the training run validates on (the target's own, never trained on).

A block drafter must guess offset j without the j - 1 tokens before it, so its agreement falls with j; the
acceptance length is 1 + the sum of the run shares. Top-2 / top-4 at offset j are what a tree of 2 / 4
candidates there would catch (docs/speculative.md weighs them against the verify rows they cost). A second
table splits offset 1 by how sure the target is of its own greedy token there. Several
checkpoints side by side:

    python experiments/dflash_offsets.py checkpoints/smollm2/dflash.pt /tmp/dflash_new.pt
    python experiments/dflash_offsets.py checkpoints/smollm2/dflash.pt --prompts mtbench --sequences 32

`--walk 2 7` also replays greedy speculation along every answer, as the engine runs it: a block drafted at the
first answer token, k of its drafts verified, the next block at the token after the accepted ones. Its tau is the
engine's for that k (no engine run needed), and it differs from the tau over every position when the drafter's
right and wrong stretches are not spread evenly: the walk skips the positions inside accepted runs.

`--denoise-steps S` walks the proposer's `denoise_steps`: offset j < S drafted with the drafts of offsets 1..j-1
filled in, the later ones with 1..S-1 (a drafter trained with `drafter.max_fill` >= S - 1).

`--tree-nodes N` also walks with a tree of the block's N likeliest paths verified instead of its chain (the engine's
`tree_nodes`, fitted to each request's room as the engine fits it), and `--tree-redraft W` redrafts its offsets 2..
under offset 1's W best tokens (`tree_redraft`; a drafter trained with max_fill >= 1), and `--tree-redraft-levels L`
its later offsets under the tree's W likeliest 2-token paths, ... L-token paths (`tree_redraft_levels`; max_fill >= L):

    python experiments/dflash_offsets.py checkpoints/smollm2/dflash_onpolicy_fill.pt --prompts gsm8k --sequences 32 \
        --max-new-tokens 256 --walk 7 --tree-nodes 62 --tree-redraft 4

`--graft-suffix C` also walks each tree with suffix decoding's chain (at min_confidence C) grafted on, as
engine/proposer=suffix_dflash_tree drafts it, the answers taken as the engine's requests one at a time:

    python experiments/dflash_offsets.py checkpoints/smollm2/dflash_onpolicy_fill3.pt --prompts mtbench \
        --sequences 32 --max-new-tokens 256 --walk 7 --tree-nodes 62 --tree-redraft 4 --tree-redraft-levels 3 \
        --graft-suffix 0.1

`--suffix-history N` first gives that suffix decoding the target's answers to N other prompts (of `--prompts`' set,
or of `--suffix-history-prompts`), as if the engine had served them before (its global table keeps the last
`max_cached_requests`, 256); `--suffix-global-min-n M` lets other requests answer only suffixes of M+ tokens:

    python experiments/dflash_offsets.py checkpoints/smollm2/dflash_onpolicy_fill3.pt --prompts gsm8k --sequences 32 \
        --walk 7 --tree-nodes 4 --graft-suffix 0.1 --suffix-history 0 100 400

`--prompts mtbench|gsm8k|...` evaluates on the target's own greedy answers to that set's prompts instead
(`--max-new-tokens` each, generated once and cached beside the training data): the prompts the engine is
measured on, which the held-out ShareGPT answers need not resemble.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from lab.drafters.checkpoint import load_drafter, resolve_checkpoint, target_fingerprint
from lab.models.sources import default_cache_dir, smollm2
from lab.runner import ModelRunner
from lab.training.data import DataConfig, Sequence, generate_responses, load_training_data, target_features
from lab.spec.feature_proposer import MAX_TREE_WIDTH
from lab.spec.proposer import Draft
from lab.spec.suffix import SuffixProposer
from lab.spec.tree import Candidates, Paths, Redrafts, depths, graft_chain, grow_redrafts, marginal_tree, walk_greedy
from lab.training.losses import (CONFIDENCE_EDGES, Batch, BlockPredictions, dflash_loss, dflash_predictions,
                                 drafted_blocks, leading_runs, make_batch)
from lab.training.recipe import evaluate
from lab.workloads.dataset_files import DATASETS


def evaluation_answers(runner: ModelRunner, feature_layers: tuple[int, ...], cache_dir: Path, num_sequences: int,
                       prompts: str | None, max_new_tokens: int) -> tuple[list[Sequence], list[torch.Tensor]]:
    """The answers to evaluate on and the target's features of them: the training run's held-out answers (prompts
    None), or the target's greedy answers to the first `num_sequences` prompts of another set."""
    if prompts is None:
        # NOTE: the training run's data settings (conf/train.yaml): its first answers are the validation set.
        sequences, features = load_training_data(runner, DataConfig(num_prompts=320, feature_layers=feature_layers),
                                                 cache_dir)
        return sequences[:num_sequences], features[:num_sequences]
    config = DataConfig(dataset=prompts, num_prompts=num_sequences, max_new_tokens=max_new_tokens)
    sequences = generate_responses(runner, config, cache_dir)
    return sequences, target_features(runner, sequences, feature_layers)


def history_answers(runner: ModelRunner, cache_dir: Path, prompts: str, count: int, max_new_tokens: int,
                    answers: list[Sequence]) -> list[Sequence]:
    """The target's greedy answers to the first `count` prompts of the set that are not among `answers`' prompts
    (the earlier traffic a suffix table may have seen; generated once and cached)."""
    if count == 0:
        return []
    asked = {tuple(a.token_ids[:a.prompt_len]) for a in answers}
    config = DataConfig(dataset=prompts, num_prompts=count + len(answers), max_new_tokens=max_new_tokens)
    others = generate_responses(runner, config, cache_dir)
    return [s for s in others if tuple(s.token_ids[:s.prompt_len]) not in asked][:count]


def offsets_table(runner: ModelRunner, paths: list[str], num_sequences: int, anchors: int, prompts: str | None = None,
                  max_new_tokens: int = 64, walk_ks: tuple[int, ...] = (), denoise_steps: int = 1,
                  tree_nodes: tuple[int, ...] = (), tree_redraft: int = 0, tree_redraft_levels: int = 1,
                  graft_suffix: float | None = None, suffix_history: tuple[int, ...] = (0,),
                  suffix_history_prompts: str | None = None,
                  suffix_global_min_n: int = 1) -> dict[str, dict[str, float]]:
    """checkpoint -> metrics averaged over `num_sequences` answers (the same anchors for every checkpoint: the
    recipe's `evaluate`, with per-offset metrics), and for each k of `walk_ks` `walk_tau_<k>` / `every_tau_<k>`
    (walk_table; also `walk_tau_<k>, tree of <N>` for N in `tree_nodes`, and with `graft_suffix` the grafted walks
    once for each count of `suffix_history`: suffix decoding given that many other answers first)."""
    cache_dir = default_cache_dir() / "train" / target_fingerprint(runner.model)
    data: dict[tuple[int, ...], tuple[list, list]] = {}   # feature layers -> the answers and their features
    results = {}
    for path in paths:
        drafter = load_drafter(resolve_checkpoint(path), "dflash", runner.model, runner.source.hf_config).float()
        if drafter.feature_layers not in data:
            data[drafter.feature_layers] = evaluation_answers(runner, drafter.feature_layers, cache_dir, num_sequences,
                                                              prompts, max_new_tokens)
        loss_fn = lambda model, batch, generator: dflash_loss(   # noqa: E731
            model, runner.model, batch, anchors, generator=generator, draft_vocab_size=8192, per_offset=True)
        results[path] = evaluate(drafter, loss_fn, data[drafter.feature_layers], max_len=512)
        steps = min(denoise_steps, drafter.config.max_fill + 1)   # NOTE: a drafter never trained with fills: 1
        if tree_redraft and drafter.config.max_fill < tree_redraft_levels:
            raise SystemExit(f"{path}: --tree-redraft drafts with offsets 1..{tree_redraft_levels} given, but this "
                             f"drafter was trained with at most {drafter.config.max_fill} (max_fill); walk it with "
                             "fewer --tree-redraft-levels, or without --tree-redraft")
        answers = data[drafter.feature_layers]
        history_set = suffix_history_prompts or prompts or "sharegpt"
        for count in suffix_history if graft_suffix is not None else (0,):
            history = history_answers(runner, cache_dir, history_set, count, max_new_tokens, answers[0])
            label = f", {count} {history_set} answers before" if count else ""
            for name, (walked, every) in walk_table(runner, drafter, answers, list(walk_ks),
                                                    steps, tree_nodes, tree_redraft, tree_redraft_levels,
                                                    graft_suffix, history, suffix_global_min_n).items():
                results[path] |= {f"walk_tau_{name}{label}": walked, f"every_tau_{name}{label}": every}
    return results


def walk(run_at: Callable[[int, int], int], length: int, num_spec_tokens: int) -> tuple[int, int]:
    """(blocks drafted, drafts accepted) of greedy speculation along one answer, as the engine runs it:
    run_at(i, room) is how many leading drafts of the block at answer token i are right (i = 0 .. length - 1, the
    answer's length - 1), its draft fitted to `room` more tokens. A step verifies up to num_spec_tokens, never past
    the answer's end, and advances past the accepted drafts and the bonus token; with no room left it runs without
    drafts (SpeculativeEngine._propose)."""
    drafts = accepted = position = 0
    while position < length:
        room = length - 1 - position   # the tokens still to come after the bonus one
        budget = min(num_spec_tokens, room)
        kept = min(budget, run_at(position, room)) if budget > 0 else 0
        drafts, accepted, position = drafts + (budget > 0), accepted + kept, position + 1 + kept
    return drafts, accepted


def top_candidates(probs: torch.Tensor) -> list:
    """probs (..., N) -> nested lists over the leading dims of each row's MAX_TREE_WIDTH likeliest (token,
    probability), those of probability 0 left out (positions past the text's end)."""
    top = probs.topk(MAX_TREE_WIDTH, dim=-1)

    def nest(values: list, ids: list) -> list:
        if values and isinstance(values[0], float):
            return [(t, p) for t, p in zip(ids, values) if p > 0]
        return [nest(v, i) for v, i in zip(values, ids)]
    return nest(top.values.tolist(), top.indices.tolist())


class TreeBlocks:
    """One answer's blocks (1, M) drafted as trees of their `max_nodes` likeliest paths through their first k offsets
    (DFlash's `tree_nodes`): each offset's MAX_TREE_WIDTH best tokens are its candidates, as in the engine; with
    `redraft` W (`tree_redraft`) the later offsets are drafted again under the tree's W likeliest 1-token paths,
    then (`levels`, `tree_redraft_levels`) under its W likeliest 2-token paths, and so on."""

    def __init__(self, predictions: BlockPredictions, k: int, max_nodes: int, redraft: int = 0, levels: int = 1,
                 drafter: torch.nn.Module | None = None, target: torch.nn.Module | None = None,
                 batch: Batch | None = None, anchors: torch.Tensor | None = None) -> None:
        probs = torch.zeros(*predictions.keep.shape, predictions.logits.shape[-1])
        probs[predictions.keep] = predictions.logits.softmax(-1)
        self.candidates = [block[:k] for block in top_candidates(probs[0])]                # M x k x W'
        self.text = predictions.labels[0].tolist()                                         # (M, B-1)

        def redrafted(depth: int, paths: list[Paths]) -> list[list[Candidates]]:
            fills = torch.tensor([block + [(0,) * depth] * (redraft - len(block)) for block in paths])   # (M, W, d)
            later = top_candidates(redrafted_probs(drafter, target, batch, anchors, fills))   # M x W x (B-1-d) x W'
            return [[rows[:k - depth] for rows in drafted[:len(block)]] for block, drafted in zip(paths, later)]
        self.redrafts: list[Redrafts] = (grow_redrafts(self.candidates, max_nodes, 0.0, redraft, min(levels, k - 1),
                                                       redrafted) if redraft else [{} for _ in self.candidates])

    def run(self, block: int, max_nodes: int, depth: int, room: int | None = None, chain: list[int] | None = None
            ) -> int:
        """How many of block `block`'s leading offsets a tree of its `max_nodes` likeliest paths through its first
        `depth` offsets holds of the text, with `chain` (suffix decoding's drafts) grafted on as the engine's
        `graft` does, fitted to `room` more tokens (None: any) as the engine fits it (Draft.fit)."""
        later = {path: rows[:depth - len(path)] for path, rows in self.redrafts[block].items()}
        token_ids, parents, path_probs = marginal_tree(self.candidates[block][:depth], max_nodes, redrafts=later)
        if chain:
            # NOTE: as the engine's graft: up to DFlashProposer.max_drafts nodes, a chain of k outranking a smaller tree
            token_ids, parents, path_probs, _ = graft_chain(token_ids, parents, path_probs, chain,
                                                            max(depth, max_nodes))
        draft = Draft(token_ids, None, parents, path_probs=path_probs)
        if room is not None:
            draft.fit(min(depth, room), room)
        text = self.text[block]
        # NOTE: on the target's greedy text, the target's token at a node's row is the text's after the node
        path, _ = walk_greedy([text[0]] + [text[d] if d < len(text) else -1 for d in depths(draft.parents)],
                              draft.token_ids, draft.parents)
        return len(path)


class SuffixChains:
    """Suffix decoding's drafts along one answer (the chain `graft` puts on each tree), from a SuffixProposer that
    has seen the earlier answers as the engine's has (finished requests join its global table)."""

    def __init__(self, proposer: SuffixProposer, sequence: Sequence, request_id: str, k: int) -> None:
        self.proposer, self.sequence, self.k = proposer, sequence, k
        self.request = _Prefix(request_id, [])   # NOTE: one object, grown as the engine's Request grows

    def at(self, position: int) -> list[int]:
        """The chain drafted after answer token `position` (called in increasing order of positions)."""
        self.request.all_token_ids = self.sequence.token_ids[:self.sequence.prompt_len + position + 1]
        return self.proposer.propose_one(self.request, self.k)

    def finish(self) -> None:
        """The answer is done: all of it joins the proposer's global table, as a finished request's does."""
        self.request.all_token_ids = list(self.sequence.token_ids)
        self.proposer.free(self.request.request_id)


@dataclass(slots=True)
class _Prefix:
    """The part of a Request a SuffixProposer reads."""

    request_id: str
    all_token_ids: list[int]


def redrafted_probs(drafter: torch.nn.Module, target: torch.nn.Module, batch: Batch, anchors: torch.Tensor,
                    fills: torch.Tensor, draft_vocab_size: int = 8192) -> torch.Tensor:
    """One answer's blocks at `anchors` (1, M) drafted again with offsets 1..d given as each of `fills` (M, W, d):
    the drafter's distributions at offsets d+1..B-1, (M, W, B-1-d, N) over the draft vocabulary
    (DFlashProposer._redraft)."""
    num_blocks, width, given = fills.shape
    repeated = anchors[0].repeat_interleave(width)[None]                                     # (1, M*W)
    hidden = drafted_blocks(drafter, target, batch, repeated, fills.reshape(1, -1, given))   # (1, M*W, B, H)
    hidden = hidden.view(num_blocks, width, drafter.block_size, -1)[:, :, 1 + given:]      # (M, W, B-1-d, H)
    return F.linear(target.norm(hidden), target.lm_head.weight[:draft_vocab_size]).float().softmax(-1)


@torch.inference_mode()
def walk_table(runner: ModelRunner, drafter: torch.nn.Module, answers: tuple[list[Sequence], list[torch.Tensor]],
               ks: list[int], denoise_steps: int = 1, tree_nodes: tuple[int, ...] = (), tree_redraft: int = 0,
               tree_redraft_levels: int = 1, graft_suffix: float | None = None,
               history: list[Sequence] | None = None, global_min_n: int = 1) -> dict[str, tuple[float, float]]:
    """"k" (and "k, tree of N" for N in `tree_nodes`) -> (tau along the engine's walk, tau over every answer
    position), pooled over the answers. With `denoise_steps` S the drafts are the proposer's: offset j < S drafted
    with offsets 1..j-1 filled in, the rest with 1..S-1 (on the target's greedy text a filled draft that counts is
    the text's token). A tree verifies the N likeliest paths of the block's first k offsets, drafted in one step
    (with `tree_redraft` W, its offsets 2.. drafted again under offset 1's W best tokens, and with
    `tree_redraft_levels` L its later offsets under its W likeliest 2-token paths, ... L-token paths). With
    `graft_suffix` (suffix decoding's min_confidence) also "k, tree of N, suffix grafted": suffix decoding's chain
    grafted onto each tree (engine/proposer=suffix_dflash_tree), the answers taken in order as the engine's
    requests one at a time, each joining the suffix tables when done, after the `history` answers (suffix decoding
    answering from other requests only suffixes of `global_min_n`+ tokens)."""
    drafter.eval()
    redrafted = f", redrafted under {tree_redraft}" if tree_redraft else ""
    redrafted += f" x {tree_redraft_levels} levels" if tree_redraft and tree_redraft_levels > 1 else ""
    if history:   # NOTE: a history changes only the grafted walks, so only they are walked
        names, grafts = [], (True,)
    else:
        names, grafts = [(str(k), k, 0, False) for k in ks], (False, True) if graft_suffix is not None else (False,)
    for graft in grafts:
        names += [(f"{k}, tree of {n}{redrafted}{', suffix grafted' if graft else ''}", k, n, graft)
                  for k in ks for n in tree_nodes]
    drafts, accepted = {name: 0 for name, *_ in names}, {name: 0 for name, *_ in names}
    every: dict[str, list[int]] = {name: [] for name, *_ in names}
    # NOTE: per grafted walk, suffix decoding for the walk's positions and for every position
    suffix = {name: (SuffixProposer(min_confidence=graft_suffix, global_min_n=global_min_n),
                     SuffixProposer(min_confidence=graft_suffix, global_min_n=global_min_n))
              for name, _, _, graft in names if graft}
    for walked_and_every in suffix.values():
        for proposer in walked_and_every:
            for sequence in history or []:
                proposer.remember(list(sequence.token_ids))
    for number, (sequence, features) in enumerate(zip(*answers)):
        batch: Batch = make_batch([sequence], [features], max_len=len(sequence.token_ids))
        anchors = torch.arange(sequence.prompt_len, len(sequence.token_ids) - 1)[None]   # (1, M): every answer token
        if anchors.shape[1] == 0:
            continue
        # NOTE: the answer is the target's greedy text: agreeing with it is what verification keeps.
        predictions = [dflash_predictions(drafter, runner.model, batch, anchors, draft_vocab_size=8192,
                                          fills=torch.full_like(anchors, fill)) for fill in range(denoise_steps)]
        agree = torch.stack([p.matches_text for p in predictions])                            # (steps, 1, M, B-1)
        offsets = torch.arange(agree.shape[-1])
        drafted = agree[offsets.clamp(max=denoise_steps - 1), ..., offsets].movedim(0, -1)   # (1, M, B-1)
        chain_runs = leading_runs(drafted)[0].long().tolist()
        trees: dict[tuple[int, int], TreeBlocks] = {}
        for name, k, nodes, graft in names:
            if nodes:
                if (k, nodes) not in trees:
                    trees[k, nodes] = TreeBlocks(predictions[0], k, nodes, tree_redraft, tree_redraft_levels, drafter,
                                                 runner.model, batch, anchors)
                blocks = trees[k, nodes]
                walked_chains = every_chains = None
                if graft:
                    walked_chains, every_chains = (SuffixChains(part, sequence, f"answer {number}", k)
                                                   for part in suffix[name])

                def run_at(i: int, room: int) -> int:
                    return blocks.run(i, nodes, k, room, walked_chains.at(i) if walked_chains else None)
                runs = [blocks.run(i, nodes, k, chain=every_chains.at(i) if every_chains else None)
                        for i in range(len(chain_runs))]
            else:
                run_at = lambda i, room: chain_runs[i]   # noqa: E731
                runs = chain_runs
            walked = walk(run_at, len(chain_runs), k)
            if graft:
                walked_chains.finish()
                every_chains.finish()
            drafts[name], accepted[name] = drafts[name] + walked[0], accepted[name] + walked[1]
            every[name] += [1 + min(run, k) for run in runs]
    return {name: (1 + accepted[name] / max(1, drafts[name]), sum(every[name]) / len(every[name]))
            for name, *_ in names}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--sequences", type=int, default=12,
                        help="answers: the training run's held-out ones, or with --prompts that many prompts' answers")
    parser.add_argument("--anchors", type=int, default=64, help="blocks per answer")
    parser.add_argument("--prompts", default=None, choices=sorted(DATASETS),
                        help="the target's answers to this set's prompts instead of the held-out ShareGPT answers")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="with --prompts: the answers' length")
    parser.add_argument("--walk", type=int, nargs="*", default=[], metavar="K",
                        help="replay greedy speculation verifying K drafts a step: the engine's tau")
    parser.add_argument("--denoise-steps", type=int, default=1,
                        help="with --walk: drafter forwards per block (engine.proposer.denoise_steps; a checkpoint "
                             "trained with a smaller max_fill walks with max_fill + 1)")
    parser.add_argument("--tree-nodes", type=int, nargs="*", default=[], metavar="N",
                        help="with --walk: also verify a tree of the N likeliest paths over the block's first K "
                             "offsets (engine.proposer.tree_nodes), drafted in one step and fitted to the answer's "
                             "room as the engine does")
    parser.add_argument("--tree-redraft", type=int, default=0, metavar="W",
                        help="with --tree-nodes: offsets 2.. drafted again under offset 1's W best tokens "
                             "(engine.proposer.tree_redraft; a drafter trained with max_fill >= 1)")
    parser.add_argument("--tree-redraft-levels", type=int, default=1, metavar="L",
                        help="with --tree-redraft: then under the tree's W likeliest 2-token paths, ... L-token paths "
                             "(engine.proposer.tree_redraft_levels; a drafter trained with max_fill >= L)")
    parser.add_argument("--graft-suffix", type=float, default=None, metavar="MIN_CONFIDENCE",
                        help="with --tree-nodes: also walk each tree with suffix decoding's chain grafted on "
                             "(engine/proposer=suffix_dflash_tree), suffix decoding at this min_confidence")
    parser.add_argument("--suffix-history", type=int, nargs="*", default=[0], metavar="N",
                        help="with --graft-suffix: walk the grafted trees again for each N, suffix decoding first "
                             "given the target's answers to N other prompts (as if served before)")
    parser.add_argument("--suffix-history-prompts", default=None, choices=sorted(DATASETS),
                        help="with --suffix-history: the set those prompts come from (default: --prompts')")
    parser.add_argument("--suffix-global-min-n", type=int, default=1, metavar="M",
                        help="with --graft-suffix: other requests answer only suffixes of M+ tokens "
                             "(engine.proposer.primary.global_min_n)")
    args = parser.parse_args()
    if args.graft_suffix is None and any(args.suffix_history):
        parser.error("--suffix-history walks the grafted trees: add --tree-nodes N --graft-suffix MIN_CONFIDENCE")
    torch.set_num_threads(1)
    runner = ModelRunner(smollm2(), dtype="float32")
    results = offsets_table(runner, args.checkpoints, args.sequences, args.anchors, args.prompts, args.max_new_tokens,
                            tuple(args.walk), args.denoise_steps, tuple(args.tree_nodes), args.tree_redraft,
                            args.tree_redraft_levels, args.graft_suffix, tuple(args.suffix_history),
                            args.suffix_history_prompts, args.suffix_global_min_n)
    names = list(results)
    columns = ("top1_at", "top2_at", "top4_at", "run_at_least")
    print("| offset j | " + " | ".join(f"top-1 {i} | top-2 {i} | top-4 {i} | run >= j {i}"
                                       for i in range(len(names))) + " |")
    print("|---|" + "---|" * len(columns) * len(names))
    longest = max(sum(k.startswith("top1_at_") for k in r) for r in results.values())   # block sizes may differ
    for j in range(1, 1 + longest):
        cells = [" | ".join(f"{results[n][f'{c}_{j}']:.3f}" for c in columns)
                 if f"top1_at_{j}" in results[n] else " | " * (len(columns) - 1) for n in names]
        print(f"| {j} | " + " | ".join(cells) + " |")
    print()
    print_confidence_table(results)
    if args.walk:
        print("| k verified | " + " | ".join(f"tau along the walk {i} | tau at every position {i}"
                                             for i in range(len(names))) + " |")
        print("|---|" + "---:|---:|" * len(names))
        walked = [key.removeprefix("walk_tau_") for key in results[names[0]] if key.startswith("walk_tau_")]
        for k in walked:
            print(f"| {k} | " + " | ".join(f"{results[n][f'walk_tau_{k}']:.3f} | {results[n][f'every_tau_{k}']:.3f}"
                                          for n in names) + " |")
        print()
    for i, name in enumerate(names):
        r = results[name]
        print(f"{i}: {name}: tau {r['acceptance_length']:.3f}, ce {r['ce']:.3f}, top-1 {r['top1_acc']:.3f}")


def print_confidence_table(results: dict[str, dict[str, float]]) -> None:
    """Offset 1 split by how sure the target is of its greedy token there: the share of positions in each bin,
    and per checkpoint how often the drafter is right inside it."""
    names = [n for n in results if "share_conf_0.0" in results[n]]   # drafters that read the target's last layer
    if not names:
        return
    print("| target's probability of its greedy token | share of offset-1 positions | "
          + " | ".join(f"offset 1 right {i}" for i in range(len(names))) + " |")
    print("|---|---:|" + "---:|" * len(names))
    for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]):
        share = results[names[0]][f"share_conf_{lo}"]
        cells = [f"{results[n][f'right_conf_{lo}'] / share:.3f}" if share else "-" for n in names]
        print(f"| [{lo}, {hi}{']' if hi == 1.0 else ')'} | {share:.3f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
