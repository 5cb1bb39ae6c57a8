"""Trees of drafts (`engine.proposer.tree_width`): several candidates verified in one target forward (EAGLE-2's
and Medusa's tree attention).

A draft tree is its tokens with the parent of each (`parents[i]`, an earlier index, or -1: the request's last
token, the root), in depth-first order with the likeliest child first, so the drafter's greedy chain leads and a
chain is the tree whose parents are -1, 0, 1, ... Two shapes are drafted:

    DFlash (`with_siblings`)                 EAGLE (`DraftTree`, a beam of W nodes a depth)
    root ── c1 ── d2 ── d3                   root ── c1 ── d2 ── d3
       ├── c2                                   │     └── e2
       └── c3                                   └── c2 ── f2

DFlash drafts every offset of its block at once from the context, so its runners-up are the first position's
alone; EAGLE runs its head again on every node it keeps, so its beam goes on under the runners-up too.

The verify step feeds the root and every node; each node takes its depth as position and sees only the context,
its ancestors and itself (SeqSlice.tree, the attention backends' hidden keys). Greedy verification walks from the
root: where the target's token is one of the node's children, that child is accepted and the walk goes on from
its row. The accepted path's keys and values (and features) are then moved to where a chain's would be.

Only greedy requests draft trees: lossless rejection sampling over several candidates (SpecInfer's) is not built,
so a sampling request's draft stays a chain. Where extra verify rows are nearly free (a GPU at batch 1), the
other candidates buy acceptance for little; on one CPU core each row costs (docs/speculative.md, session 22).

Owns: the trees' shapes: building, growing, cutting and walking them.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

ROOT = -1


def chain_parents(length: int) -> list[int]:
    """A chain of `length` drafts as a tree: each token's parent is the one before it."""
    return list(range(-1, length - 1))


def with_siblings(chain: list[int], siblings: list[int], tails: bool = False) -> tuple[list[int], list[int]]:
    """The chain (its first token being the drafter's best candidate) plus `siblings`, other candidates for the
    first position, each followed by the chain's later tokens with `tails` -> (token_ids, parents) in depth-first
    order. Siblings equal to the chain's first token are dropped."""
    siblings = [t for t in dict.fromkeys(siblings) if not chain or t != chain[0]]
    if not chain:
        return [], []
    tokens, parents = list(chain), chain_parents(len(chain))
    tail = chain[1:] if tails else []
    for sibling in siblings:
        start = len(tokens)
        tokens += [sibling] + tail
        parents += [ROOT] + list(range(start, start + len(tail)))
    return tokens, parents


def depths(parents: list[int]) -> list[int]:
    """The depth of every node (1: a child of the root)."""
    out: list[int] = []
    for i, parent in enumerate(parents):
        if not ROOT <= parent < i:
            raise ValueError(f"draft {i} has parent {parent}: parents must come before their children")
        out.append(1 if parent == ROOT else out[parent] + 1)
    return out


def row_prefixes(token_ids: list[int], parents: list[int] | None) -> list[list[int]]:
    """The drafted tokens each verify row follows: the root's row none, node i's row the tokens from the root's
    child down to node i (a chain, parents None: drafts 0..i) -> 1 + n lists."""
    prefixes: list[list[int]] = [[]]
    for i, parent in enumerate(parents if parents is not None else chain_parents(len(token_ids))):
        prefixes.append(prefixes[parent + 1] + [token_ids[i]])
    return prefixes


def likeliest(parents: list[int], path_probs: list[float], max_nodes: int) -> list[bool]:
    """Which nodes are the `max_nodes` likeliest (ties: the earlier). No node is likelier than its parent, so
    they are a tree."""
    ranked = sorted(range(len(parents)), key=lambda node: (-path_probs[node], node))
    chosen = set(ranked[:max_nodes])
    return [node in chosen for node in range(len(parents))]


def subtree(token_ids: list[int], parents: list[int], keep: list[bool]) -> tuple[list[int], list[int]]:
    """The nodes `keep` marks (with every ancestor of each), in their order, parents re-indexed."""
    kept: dict[int, int] = {}
    tokens, new_parents = [], []
    for i, (token, parent) in enumerate(zip(token_ids, parents)):
        if keep[i]:
            if parent != ROOT and parent not in kept:
                raise ValueError(f"node {i} is kept without its parent {parent}")
            kept[i] = len(tokens)
            tokens.append(token)
            new_parents.append(ROOT if parent == ROOT else kept[parent])
    return tokens, new_parents


class DraftTree:
    """A tree while a drafter grows it depth by depth (EAGLE's beam): nodes in the order drafted (parents first),
    each with its path probability (the drafter's probabilities multiplied along the path). The drafter's greedy
    chain (the best child of the chain's tip, depth after depth) is always part of it while it lasts; the other
    nodes of a level are the most probable of the rest."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.parents: list[int] = []
        self.path_probs: list[float] = []
        self.frontier: list[int] = []         # the nodes of the deepest level, expanded next
        self.chain_tip: int | None = ROOT     # the greedy chain's last node (ROOT: none yet); None: it stopped

    def grow(self, candidates: list[tuple[int, int, float]], width: int, min_prob: float,
             chain: tuple[int, int, float] | None) -> None:
        """candidates (parent, token, path probability) -> the next level: `chain` (the chain's next node, or None:
        the chain stops), then the most probable other candidates, up to `width` nodes, none below `min_prob`."""
        others = sorted((c for c in candidates if c != chain and c[2] >= min_prob), key=lambda c: -c[2])
        level = ([chain] if chain is not None else []) + others
        self.frontier = []
        for parent, token, prob in level[:width]:
            self.frontier.append(len(self.token_ids))
            self.token_ids.append(token)
            self.parents.append(parent)
            self.path_probs.append(prob)
        self.chain_tip = self.frontier[0] if chain is not None else None

    def depth_first(self) -> tuple[list[int], list[int], list[float]]:
        """(token_ids, parents, path_probs) in depth-first order, the more probable child first."""
        return depth_first(self.token_ids, self.parents, self.path_probs)


def depth_first(token_ids: list[int], parents: list[int], path_probs: list[float]
                ) -> tuple[list[int], list[int], list[float]]:
    """A tree whose parents come before their children -> (token_ids, parents, path_probs) in depth-first order,
    the more probable child first, so the likeliest path is the leading chain (whose acceptance needs no move of
    keys)."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    tokens: list[int] = []
    new_parents: list[int] = []
    probs: list[float] = []
    stack = [(node, ROOT) for node in sorted(children.get(ROOT, []), key=lambda n: path_probs[n])]
    while stack:
        node, parent = stack.pop()
        index = len(tokens)
        tokens.append(token_ids[node])
        new_parents.append(parent)
        probs.append(path_probs[node])
        stack.extend((child, index) for child in sorted(children.get(node, []), key=lambda n: path_probs[n]))
    return tokens, new_parents, probs


Candidates = list[list[tuple[int, float]]]   # per drafted position its likeliest (token, probability), best first
# NOTE: a path of drafted tokens from the root (offsets 1..d) -> the candidates of positions d + 1.. drafted again with
# that path given (DFlash's `tree_redraft`)
Redrafts = dict[tuple[int, ...], Candidates]


def marginal_tree(candidates: Candidates, max_nodes: int, min_prob: float = 0.0,
                  redrafts: Redrafts | None = None) -> tuple[list[int], list[int], list[float]]:
    """A block drafter's tree (DFlash's `tree_nodes`): candidates[d] are position d + 1's likeliest tokens with the
    drafter's probabilities, most probable first, each position guessed apart from the others (its marginal).
    A path's probability is the product of its tokens' -> the `max_nodes` most probable paths (at least
    `min_prob` each) as a tree (token_ids, parents, path_probs) in depth-first order, the greedy chain leading.
    With `redrafts` (DFlash's `tree_redraft`), the children of a node whose path was drafted again take their
    candidates from that redraft, and so do their descendants, down to the next redrafted path: a node's later
    positions come from the deepest redraft along its path, the block's own candidates where there is none.

    Best first: a path is never likelier than its parent or than the same path with its last token swapped for a
    likelier one, so popping the likeliest open path and opening its first child and its next sibling visits the
    paths in order of probability, touching about 2 * max_nodes of them."""
    sources: Redrafts = {(): candidates, **(redrafts or {})}

    def level(source: tuple[int, ...], depth: int) -> list[tuple[int, float]]:
        """The candidates at `depth` (0: the first position) drafted with the path `source` given."""
        drafted = sources[source]
        return drafted[depth - len(source)] if depth - len(source) < len(drafted) else []

    token_ids: list[int] = []
    parents: list[int] = []
    path_probs: list[float] = []
    paths: list[tuple[int, ...]] = []
    first = level((), 0)
    # NOTE: an open path: (-probability, tiebreak, rank among its siblings, parent node, the redraft its level is from)
    frontier = [(-first[0][1], 0, 0, ROOT, ())] if first else []
    opened = 1
    while frontier and len(token_ids) < max_nodes:
        neg_prob, _, rank, parent, source = heapq.heappop(frontier)
        if -neg_prob < min_prob:
            break
        above = () if parent == ROOT else paths[parent]
        node, tokens = len(token_ids), level(source, len(above))
        path = above + (tokens[rank][0],)
        token_ids.append(path[-1])
        parents.append(parent)
        path_probs.append(-neg_prob)
        paths.append(path)
        parent_prob = 1.0 if parent == ROOT else path_probs[parent]
        if rank + 1 < len(tokens):   # the next sibling
            heapq.heappush(frontier, (-parent_prob * tokens[rank + 1][1], opened, rank + 1, parent, source))
            opened += 1
        below = path if path in sources else source
        children = level(below, len(path))
        if children:   # the first child
            heapq.heappush(frontier, (neg_prob * children[0][1], opened, 0, node, below))
            opened += 1
    return depth_first(token_ids, parents, path_probs)


def likeliest_paths(token_ids: list[int], parents: list[int], path_probs: list[float], depth: int,
                    count: int) -> list[tuple[int, ...]]:
    """A tree's `count` likeliest nodes `depth` deep, as their paths from the root (ties: the earlier node): the
    paths a redraft gives its drafter (DFlash's `tree_redraft`)."""
    at_depth = [node for node, d in enumerate(depths(parents)) if d == depth]
    prefixes = row_prefixes(token_ids, parents)
    return [tuple(prefixes[node + 1]) for node in sorted(at_depth, key=lambda n: (-path_probs[n], n))[:count]]


Paths = list[tuple[int, ...]]


def grow_redrafts(candidates: list[Candidates], max_nodes: int, min_prob: float, width: int, levels: int,
                  redraft: Callable[[int, list[Paths]], list[list[Candidates]]]) -> list[Redrafts]:
    """Several blocks' trees (marginal_tree of each block's `candidates`) redrafted level by level (DFlash's
    `tree_redraft`, `tree_redraft_levels`): level d = 1..levels takes each tree as grown so far, its `width` likeliest
    d-token paths, and asks `redraft(d, paths)` (per tree its paths) for the positions after them drafted again with
    each path given (per tree, per path, their candidates) -> per tree its Redrafts. The engine (DFlashProposer) and
    the offline walk (experiments/dflash_offsets.py) grow their trees here, so they grow the same ones."""
    out: list[Redrafts] = [{} for _ in candidates]
    for depth in range(1, levels + 1):
        paths = [likeliest_paths(*marginal_tree(block, max_nodes, min_prob, redrafts), depth, width)
                 for block, redrafts in zip(candidates, out)]
        if not any(paths):   # NOTE: no tree is that deep, nor deeper
            break
        for redrafts, tree_paths, drafted in zip(out, paths, redraft(depth, paths)):
            redrafts.update(zip(tree_paths, drafted))
    return out


def graft_chain(token_ids: list[int], parents: list[int], path_probs: list[float], chain: list[int], max_nodes: int,
                chain_probs: list[float] | None = None) -> tuple[list[int], list[int], list[float], int]:
    """A tree (token_ids, parents, path_probs) with `chain` (another proposer's drafts, e.g. suffix decoding's)
    grafted on from the root: the chain follows the tree's nodes while they spell it, and goes on as new nodes where
    they stop. Without `chain_probs` a grafted node is as likely as its parent (the chain's proposer drafts only
    where it is sure), so the whole chain is kept when the tree is cut back to its `max_nodes` likeliest nodes, the
    tree's least likely ones leaving for it. With `chain_probs` (the chain's own path probability at each token) a
    chain node ranks by it (the larger of the two where the tree has the node too), and the cut keeps the
    `max_nodes` likeliest of both -> (token_ids, parents, path_probs) in depth-first order, the number of nodes
    grafted."""
    children = {(parent, token): node for node, (parent, token) in enumerate(zip(parents, token_ids))}
    token_ids, parents, path_probs = list(token_ids), list(parents), list(path_probs)
    node, grafted = ROOT, 0
    for depth, token in enumerate(chain[:max_nodes]):
        if (node, token) in children:
            node = children[node, token]
            if chain_probs is not None:
                path_probs[node] = max(path_probs[node], chain_probs[depth])
            continue
        path_probs.append((1.0 if node == ROOT else path_probs[node]) if chain_probs is None else chain_probs[depth])
        token_ids.append(token)
        parents.append(node)
        node, grafted = len(token_ids) - 1, grafted + 1
    if len(token_ids) > max_nodes:
        # NOTE: without chain_probs the chain ranks above every node of the tree off it (ties go to the earlier node)
        ranks = path_probs if chain_probs is not None else [
            2.0 if rank_above else p for p, rank_above in zip(path_probs, on_path(parents, node))]
        token_ids, parents, path_probs = cut(token_ids, parents, path_probs, likeliest(parents, ranks, max_nodes))
    return (*depth_first(token_ids, parents, path_probs), grafted)


def on_path(parents: list[int], node: int) -> list[bool]:
    """Which nodes lie on the path from the root down to `node` (ROOT: none)."""
    marked = [False] * len(parents)
    while node != ROOT:
        marked[node] = True
        node = parents[node]
    return marked


def cut(token_ids: list[int], parents: list[int], path_probs: list[float] | None, keep: list[bool]
        ) -> tuple[list[int], list[int], list[float] | None]:
    """subtree() that keeps each kept node's path probability beside it (None: none known)."""
    kept_tokens, kept_parents = subtree(token_ids, parents, keep)
    return kept_tokens, kept_parents, None if path_probs is None else [p for p, k in zip(path_probs, keep) if k]


def walk_greedy(target_ids: list[int], token_ids: list[int], parents: list[int]) -> tuple[list[int], int]:
    """target_ids (1 + n): the target's greedy token at the root's row, then at each node's row -> (the accepted
    nodes from the root down, the target's token after the last of them)."""
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(parents):
        children.setdefault(parent, []).append(i)
    path, node = [], ROOT
    while True:
        target = target_ids[node + 1]
        node = next((c for c in children.get(node, ()) if token_ids[c] == target), None)
        if node is None:
            return path, target
        path.append(node)
