"""The drafters' training objectives, on batches of target-generated sequences with cached target features.

- EAGLE: at every position i the head reads (feature i-1, token i) and predicts feature i (the target's
  last hidden state after its final norm): smooth-L1 regression to it plus the cross-entropy of the
  target's head on it against the target's own next-token distribution at i (soft labels: the head on
  the target's feature), both over the draft vocabulary the proposer drafts from (EAGLE's 1.0 / 0.1
  weighting); input features get uniform noise, as EAGLE trains for its own drift. Soft labels make any
  text a valid corpus: what is learnt is what the target would say next, not what the text says.
- DFlash: random anchor positions in each answer; the block after an anchor (the anchor's token + B-1
  masks) must predict the next B-1 tokens seeing only context before the anchor; cross-entropy per block
  position with weights exp(-(j-1)/gamma), since early positions decide the acceptance length. The
  labels are the target's own distributions at those positions (its last layer is among the features
  DFlash reads), over the draft vocabulary; hard next-token labels over the whole vocabulary otherwise.
  With soft labels, offset j counts only while the text's tokens at offsets 1..j-1 are the target's greedy
  ones (`greedy_path`): past a token the target would not have written (a recorded answer's), its label
  is the target conditioned on a token the drafter never sees, not the block it will be asked to verify.

Owns: batching (padding), the losses and their validation metrics. Ignores: optimisation and data making.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.drafters.dflash import DFlashDrafter, block_mask
from lab.drafters.eagle import EagleDrafter
from lab.errors import LabError
from lab.kv_cache.base import NoCache
from lab.models.decoder import DecoderModel
from lab.training.data import FeatureFn, Sequence


@dataclass(slots=True)
class Batch:
    token_ids: torch.Tensor      # (S, T) padded with 0
    features: torch.Tensor       # (S, T, F) fp32
    lengths: torch.Tensor        # (S,)
    prompt_lens: torch.Tensor    # (S,)


def make_batch(sequences: list[Sequence], features: list[torch.Tensor] | None, max_len: int,
               device: torch.device | str = "cpu",
               compute_features: FeatureFn | None = None) -> Batch:
    """Pad into one batch: built on the CPU, where the cached features are, then moved to `device`; with
    features None, `compute_features` (data.online_features) computes them there from the padded token ids and
    the lengths."""
    lengths = [min(len(s.token_ids), max_len) for s in sequences]
    longest = max(lengths)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    for row, (seq, n) in enumerate(zip(sequences, lengths)):
        ids[row, :n] = torch.tensor(seq.token_ids[:n])
    ids = ids.to(device)
    if features is None:
        if compute_features is None:
            raise LabError("make_batch got no features and no way to compute them", "pass compute_features")
        feats = compute_features(ids, lengths)   # (S, T, F); zeros past each end, as cached
    else:
        feats = torch.zeros(len(sequences), longest, features[0].shape[-1])
        for row, (feat, n) in enumerate(zip(features, lengths)):
            feats[row, :n] = feat[:n].float()
        feats = feats.to(device)
    prompt_lens = torch.tensor([min(s.prompt_len, n) for s, n in zip(sequences, lengths)])
    return Batch(ids, feats, torch.tensor(lengths, device=device), prompt_lens.to(device))


def eagle_loss(drafter: EagleDrafter, target: DecoderModel, batch: Batch, ce_weight: float = 0.1,
               noise: float = 0.1, ce_positions: int = 128, generator: torch.Generator | None = None,
               draft_vocab_size: int = 0) -> tuple[torch.Tensor, dict[str, float]]:
    s, t = batch.token_ids.shape
    device = batch.token_ids.device
    with torch.no_grad():   # EAGLE's features are the target's last hidden states after the final norm
        features = target.norm(batch.features)                                    # (S, T, H)
    prev = torch.cat((features.new_zeros(s, 1, features.shape[-1]), features[:, :-1]), dim=1)
    if noise and drafter.training:
        prev = prev + (torch.rand(prev.shape, generator=generator).to(device) - 0.5) * 2 * noise
    positions = torch.arange(t, device=device)[None].expand(s, t)
    with torch.no_grad():
        embeds = target.embed_tokens(batch.token_ids)
    predicted = drafter(embeds, prev, positions, NoCache())                        # (S, T, H)
    valid = torch.arange(t, device=device)[None] < batch.lengths[:, None]          # (S, T)
    regression = (F.smooth_l1_loss(predicted, features, reduction="none").mean(-1) * valid).sum() / valid.sum()
    # NOTE: the head's cross-entropy at a sample of answer positions i (predicting token i + 1): the head is
    # thousands of rows wide, so every position would dominate the step's cost for little gain.
    rows, cols = [], []
    for row in range(s):
        candidates = torch.arange(max(0, int(batch.prompt_lens[row]) - 1), int(batch.lengths[row]) - 1)
        pick = candidates[torch.randperm(len(candidates), generator=generator)[:ce_positions]]
        rows.append(torch.full_like(pick, row))
        cols.append(pick)
    rows, cols = torch.cat(rows).to(device), torch.cat(cols).to(device)
    weight, bias = _head(target, draft_vocab_size)
    logits = F.linear(predicted[rows, cols], weight, bias).float()                 # (P, N)
    with torch.no_grad():
        teacher = F.linear(features[rows, cols], weight, bias).float().softmax(-1)  # (P, N): the target's own
    ce, kl = _soft_cross_entropy(logits, teacher)                                   # (P,), (P,)
    accuracy = (logits.argmax(-1) == teacher.argmax(-1)).float().mean()
    return regression + ce_weight * ce.mean(), {"regression": regression.item(), "ce": ce.mean().item(),
                                                "kl": kl.mean().item(), "top1_acc": float(accuracy)}


def _soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits (P, N) against target distributions probs (P, N) -> (cross-entropy, KL divergence), each (P,):
    the KL is the cross-entropy minus the targets' entropy (0 = a perfect copy)."""
    ce = -(probs * logits.log_softmax(-1)).sum(-1)
    return ce, ce + torch.special.xlogy(probs, probs).sum(-1)


def sample_anchors(batch: Batch, num_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(S, M) anchor positions in each answer (a block predicts tokens anchor+1 .. anchor+B-1), on the batch's
    device (drawn on the CPU, where `generator` is)."""
    anchors = []
    for length, prompt_len in zip(batch.lengths.tolist(), batch.prompt_lens.tolist()):
        low, high = max(1, prompt_len - 1), max(1, length - 2)
        anchors.append(torch.randint(low, max(low + 1, high + 1), (num_anchors,), generator=generator))
    return torch.stack(anchors).to(batch.token_ids.device)


@dataclass(slots=True)
class BlockPredictions:
    """A DFlash drafter's top-1 guesses for the blocks at some anchors (S, M), scored against the target."""
    labels: torch.Tensor               # (S, M, B-1) the text's tokens at offsets 1..B-1, -100 past its end
    keep: torch.Tensor                 # (S, M, B-1) bool: the positions scored
    logits: torch.Tensor               # (P, N) the drafter's at `keep`'s positions
    targets: torch.Tensor              # (P,) the target's greedy token there (soft labels) or the text's (hard)
    probs: torch.Tensor | None         # (P, N) the target's distributions (soft labels), else None

    @property
    def correct(self) -> torch.Tensor:
        """(S, M, B-1) bool: the drafter's top-1 is the target's (False where not scored)."""
        return self._agree(self.targets)

    @property
    def matches_text(self) -> torch.Tensor:
        """(S, M, B-1) bool: the drafter's top-1 is the text's token. On the target's own greedy text this is what
        verification accepts, also where the target's token lies outside the draft vocabulary (the teacher's
        argmax over the draft vocabulary is then some other token)."""
        return self._agree(self.labels[self.keep])

    def runs(self, of_text: bool = False) -> torch.Tensor:
        """(S, M): each block's leading right drafts (greedy verification accepts that many)."""
        return leading_runs(self.matches_text if of_text else self.correct)

    def _agree(self, tokens: torch.Tensor) -> torch.Tensor:
        agree = torch.zeros_like(self.labels, dtype=torch.bool)
        agree[self.keep] = self.logits.argmax(-1) == tokens
        return agree


def leading_runs(agree: torch.Tensor) -> torch.Tensor:
    """(S, M, B-1) bool -> (S, M): how many of each block's drafts are right before its first wrong one."""
    return torch.cumprod(agree.float(), dim=-1).sum(-1)


def drafted_blocks(drafter: DFlashDrafter, target: DecoderModel, batch: Batch, anchors: torch.Tensor,
                   fill_ids: torch.Tensor | None = None, filled: torch.Tensor | None = None) -> torch.Tensor:
    """The drafter's blocks at `anchors` (S, M), each seeing the context before it: the anchor's token, then
    fill_ids (S, M, F) given at offsets 1..F (the first of them that `filled` (S, M, F) marks; None: all), then
    masks -> hidden states (S, M, B, H)."""
    s, t = batch.token_ids.shape
    block = drafter.block_size
    block_positions = (anchors[..., None] + torch.arange(block, device=anchors.device)).reshape(s, -1)   # (S, M*B)
    stream = drafter.context_stream(batch.features)                                # (S, T, H)
    context = drafter.stream_kv(stream, torch.arange(t, device=stream.device)[None].expand(s, t))
    with torch.no_grad():
        first = target.embed_tokens(batch.token_ids.gather(1, anchors))            # (S, M, H)
        fill_embeds = None if fill_ids is None else target.embed_tokens(fill_ids)  # (S, M, F, H)
    last = stream.gather(1, (anchors - 1)[..., None].expand(-1, -1, stream.shape[-1]))    # (S, M, H): before each block
    hidden = drafter(drafter.block_inputs(first, last, fill_embeds=fill_embeds, filled=filled), block_positions,
                     context, block_mask(batch.lengths, anchors, t, block))         # (S, M*B, H)
    return hidden.view(s, anchors.shape[1], block, -1)


def dflash_predictions(drafter: DFlashDrafter, target: DecoderModel, batch: Batch, anchors: torch.Tensor,
                       draft_vocab_size: int = 0, greedy_path: bool = True,
                       fills: torch.Tensor | None = None) -> BlockPredictions:
    """The drafter's block at each anchor (S, M): the anchor's token + B-1 masks, seeing the context before it;
    labelled with the target's own distributions (its last layer among the features, over the draft vocabulary),
    else with the text's next tokens over the whole vocabulary. fills (S, M): each block's first `fills` offsets
    hold the text's tokens instead of masks and are not scored (None: none); on the target's greedy path those are
    the drafts a denoising step has committed (DFlashProposer's `denoise_steps`)."""
    s, t = batch.token_ids.shape
    block, num_anchors = drafter.block_size, anchors.shape[1]
    offsets = torch.arange(block, device=batch.token_ids.device)
    block_positions = (anchors[..., None] + offsets).reshape(s, -1)                # (S, M*B)
    label_positions = block_positions.clamp(max=t - 1)
    text = batch.token_ids.gather(1, label_positions).view(s, num_anchors, block)[:, :, 1:]   # (S, M, B-1)
    labels = text.masked_fill((block_positions >= batch.lengths[:, None]).view(s, num_anchors, block)[:, :, 1:], -100)
    num_fills = 0 if fills is None else int(fills.max())
    filled = None if not num_fills else torch.arange(num_fills, device=anchors.device) < fills[..., None]
    hidden = drafted_blocks(drafter, target, batch, anchors, text[:, :, :num_fills] if num_fills else None,
                            filled)[:, :, 1:]                                      # (S, M, B-1, H)
    keep = labels >= 0                                                             # (S, M, B-1)
    teacher = _dflash_teacher(drafter, target, batch, anchors, block)               # (S, M, B-1, H) or None
    weight, bias = _head(target, draft_vocab_size if teacher is not None else 0)
    if teacher is None:   # hard labels: the sequence's next tokens (the target's own when it wrote them)
        probs, targets = None, labels[keep]
    else:                 # soft labels: the target's distribution before each block position
        with torch.no_grad():
            probs = F.linear(target.norm(teacher[keep]), weight, bias).float().softmax(-1)   # (P, N)
        targets = probs.argmax(-1)
        if greedy_path:
            on_path = on_greedy_path(labels, keep, targets)
            probs, targets = probs[on_path[keep]], targets[on_path[keep]]
            keep = keep & on_path
    if filled is not None:   # NOTE: after the greedy path, which reads the filled offsets' greedy tokens too
        drafted = torch.ones_like(keep)
        drafted[..., :num_fills] = ~filled
        targets, probs = targets[drafted[keep]], None if probs is None else probs[drafted[keep]]
        keep = keep & drafted
    logits = F.linear(target.norm(hidden[keep]), weight, bias).float()              # (P, N)
    return BlockPredictions(labels, keep, logits, targets, probs)


def dflash_loss(drafter: DFlashDrafter, target: DecoderModel, batch: Batch, num_anchors: int = 16,
                gamma: float = 7.0, generator: torch.Generator | None = None, draft_vocab_size: int = 0,
                per_offset: bool = False, greedy_path: bool = True, max_fill: int = 0,
                fill_weights: tuple[float, ...] | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The weighted block cross-entropy and its metrics. max_fill > 0: each block's first f offsets are given as
    the text's tokens, f in 0..max_fill drawn uniformly or by `fill_weights` (max_fill + 1 relative weights, the
    first for f = 0), and offset j weighs as offset j - f would (the first drafted one most); the acceptance
    metrics (`acceptance_length`, `top1_first`, per offset) count the blocks with f = 0, and `top1_after_fill` is
    the first drafted offset's agreement in the others."""
    if per_offset and max_fill:
        raise ValueError("the per-offset metrics score whole blocks of masks: set max_fill=0 with per_offset")
    block = drafter.block_size
    anchors = sample_anchors(batch, num_anchors, generator)
    fills = None
    if max_fill > 0:
        fills = draw_fills(anchors.shape, max_fill, fill_weights, generator).to(anchors.device)        # (S, M)
    blocks = dflash_predictions(drafter, target, batch, anchors, draft_vocab_size, greedy_path, fills)
    labels, keep, logits, targets, probs = blocks.labels, blocks.keep, blocks.logits, blocks.targets, blocks.probs
    offsets = torch.arange(1, block, device=logits.device).expand_as(labels)
    if fills is not None:
        offsets = offsets - fills[..., None]
    weights = torch.exp(-(offsets.float() - 1) / gamma)[keep]
    if probs is None:
        ce = kl = F.cross_entropy(logits, targets, reduction="none")
    else:
        ce, kl = _soft_cross_entropy(logits, probs)
    kl = (kl * weights).sum() / weights.sum()
    ce = (ce * weights).sum() / weights.sum()
    correct = blocks.correct
    metrics = {"ce": ce.item(), "kl": kl.item(), "top1_acc": float(correct[keep].float().mean())}
    if fills is not None:   # NOTE: the acceptance metrics below read the unfilled blocks alone
        after = (offsets == 1) & keep & (fills[..., None] > 0)
        metrics["top1_after_fill"] = float(correct[after].float().mean()) if after.any() else 0.0
        plain = fills == 0
        correct, keep, labels = correct[plain][None], keep[plain][None], labels[plain][None]   # (1, M', B-1)
    # NOTE: greedy acceptance length of each block = 1 + the run of correct predictions from its start.
    accepted = leading_runs(correct)                                               # (S, M)
    metrics |= {"top1_first": float(correct[..., 0][keep[..., 0]].float().mean()),   # offset 1 alone (EAGLE's task)
                "acceptance_length": float(1 + accepted.mean())}
    if per_offset:   # top-1 at every offset j, and the share of blocks whose first j drafts are all right
        # NOTE: top-k (k = 2, 4) is what a tree of k candidates at offset j would catch.
        ranks = (logits > logits.gather(1, targets[:, None])).sum(-1)             # (P,): 0 = the top-1
        for width in (2, 4):
            hit = torch.zeros_like(labels, dtype=torch.bool)
            hit[keep] = ranks < width
            for j in range(block - 1):
                metrics[f"top{width}_at_{j + 1}"] = float(hit[..., j][keep[..., j]].float().mean())
        for j in range(block - 1):
            metrics[f"top1_at_{j + 1}"] = float(correct[..., j][keep[..., j]].float().mean())
            metrics[f"run_at_least_{j + 1}"] = float((accepted >= j + 1).float().mean())
        if probs is not None:
            metrics.update(_first_offset_by_confidence(probs, correct[keep], keep))
    return ce, metrics


def draw_fills(shape: torch.Size, max_fill: int, weights: tuple[float, ...] | None,
               generator: torch.Generator | None) -> torch.Tensor:
    """How many of each block's first offsets are given, (shape) in 0..max_fill: uniform (weights None), else
    f drawn with probability weights[f] / sum(weights)."""
    if weights is None:
        return torch.randint(0, max_fill + 1, shape, generator=generator)
    if len(weights) != max_fill + 1:   # NOTE: multinomial itself refuses negative, infinite or all-zero weights
        raise ValueError(f"fill_weights needs max_fill + 1 = {max_fill + 1} weights, got {weights}")
    probs = torch.tensor(weights, dtype=torch.float64)
    return torch.multinomial(probs, math.prod(shape), replacement=True, generator=generator).view(shape)


CONFIDENCE_EDGES = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)


def _first_offset_by_confidence(probs: torch.Tensor, correct: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
    """Offset-1 agreement split by how sure the target is of its own greedy token there (its largest probability
    over the draft vocabulary): `share_conf_<lo>` of the offset-1 positions fall in [lo, next edge), and at
    `right_conf_<lo>` of all of them the target is that sure and the drafter right (shares, not ratios, so that
    batches average without empty bins; agreement inside a bin = right / share). probs (P, N), correct (P,): the
    kept positions in `keep`'s order."""
    first = torch.zeros_like(keep)
    first[..., 0] = True
    at_first = first[keep]                                                         # (P,) offset-1 rows
    sure = probs[at_first].amax(-1)                                                # (P1,)
    right = correct[at_first].float()
    metrics = {}
    for lo, hi in zip(CONFIDENCE_EDGES, CONFIDENCE_EDGES[1:]):
        inside = (sure >= lo) & ((sure < hi) if hi < 1.0 else (sure <= hi))
        metrics[f"share_conf_{lo}"] = float(inside.float().mean())
        metrics[f"right_conf_{lo}"] = float((right * inside).mean())
    return metrics


def on_greedy_path(labels: torch.Tensor, keep: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """(S, M, B-1) bool: block label j is reached along the target's greedy path, i.e. the text's tokens at
    offsets 1..j-1 are each the target's greedy token there. labels (S, M, B-1): the text's tokens at offsets
    1..B-1; greedy (P,): the target's greedy token at each of `keep`'s positions (the same offsets)."""
    chosen = torch.full_like(labels, -1)
    chosen[keep] = greedy
    follows = labels == chosen                                                     # the text's token is greedy
    before = torch.cat((torch.ones_like(follows[..., :1]), follows[..., :-1]), dim=-1)   # offset 1: nothing before
    return keep & torch.cumprod(before.int(), dim=-1).bool()


def _head(target: DecoderModel, draft_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's LM head over its first `draft_vocab_size` token ids (0: all): (weight (N, H), bias)."""
    head = target.lm_head
    vocab = draft_vocab_size if 0 < draft_vocab_size < head.weight.shape[0] else head.weight.shape[0]
    return head.weight[:vocab], None if head.bias is None else head.bias[:vocab]


def _dflash_teacher(drafter: DFlashDrafter, target: DecoderModel, batch: Batch, anchors: torch.Tensor,
                    block: int) -> torch.Tensor | None:
    """The target's last-layer states (pre-norm) at the position before each block label, (S, M, B-1, H),
    when the drafter's features include the last layer; else None."""
    last = len(target.layers) - 1
    if last not in drafter.feature_layers:
        return None
    hidden = target.norm.weight.shape[0]
    column = drafter.feature_layers.index(last) * hidden
    s, t, _ = batch.features.shape
    positions = (anchors[..., None] + torch.arange(block - 1, device=anchors.device)).clamp(max=t - 1).reshape(s, -1)
    states = batch.features[..., column:column + hidden].gather(1, positions[..., None].expand(-1, -1, hidden))
    return states.view(s, anchors.shape[1], block - 1, hidden)


def cosine_lr(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
