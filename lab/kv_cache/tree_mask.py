"""The attention layout of a tree of drafts in a step (SeqSlice.tree; lab/spec/tree.py builds the trees): each token's
position is the context plus its depth, and it sees the context, its ancestors and itself. The native kernel reads
that as hidden-key bits per token (`StepIndex.hidden`); the SDPA-based backends clear those entries of their masks.

Owns: turning a tree's parents into depths, hidden-key bits and mask entries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lab.kv_cache.block_kv import StepIndex

NO_HIDDEN = torch.empty(0, dtype=torch.long)   # the kernels' "every token sees every key before it"
MAX_TREE_TOKENS = 63   # a step's tree: the hidden-key bits of an int64 (the sign bit unused)


def tree_layout(parents: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """A step's tree of T query tokens (`SeqSlice.tree`: the parent of tokens 1..T-1; -1: a token that hangs on
    the context itself, as token 0 does: a drafter's first-position candidates) -> (each token's depth, each
    token's hidden-key bits: bit b = it does not see token j - b, the keys before the step all seen)."""
    if len(parents) >= MAX_TREE_TOKENS:
        raise ValueError(f"a tree of {len(parents) + 1} tokens: at most {MAX_TREE_TOKENS} fit the hidden-key bits")
    depth, ancestors = [0], [1]                    # ancestors[j]: bit i = token i is j or one of j's ancestors
    for j, parent in enumerate(parents, start=1):
        if not -1 <= parent < j:
            raise ValueError(f"tree token {j} has parent {parent}: a parent must come before its children")
        depth.append(0 if parent < 0 else depth[parent] + 1)
        ancestors.append((0 if parent < 0 else ancestors[parent]) | 1 << j)
    hidden = []
    for j, seen in enumerate(ancestors):
        hidden.append(sum(1 << (j - i) for i in range(j) if not seen >> i & 1))
    return depth, hidden


def hidden_keys(index: StepIndex, i: int) -> list[tuple[int, int]]:
    """The (query token, key position) pairs that request i's tree of drafts hides: the masks' False entries
    beyond causality (SDPA-based backends; the native kernel reads `index.hidden` itself)."""
    seq = index.seqs[i]
    if seq.tree is None:
        return []
    start = index.q_start[i]
    bits = index.hidden[start:start + seq.num_query_tokens].tolist()
    return [(t, seq.num_context_tokens + t - b) for t, row in enumerate(bits)
            for b in range(1, row.bit_length()) if row >> b & 1]
