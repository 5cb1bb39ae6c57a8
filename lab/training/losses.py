"""The drafters' training objectives, on batches of target-generated sequences with cached target features.

- EAGLE: at every position i the head reads (feature i-1, token i) and predicts feature i (the target's
  last hidden state after its final norm): smooth-L1 regression to it plus cross-entropy of the target's
  head on it against token i+1
  (EAGLE's 1.0 / 0.1 weighting); input features get uniform noise, as EAGLE trains for its own drift.
- DFlash: random anchor positions in each answer; the block after an anchor (the anchor's token + B-1
  masks) must predict the next B-1 tokens seeing only context before the anchor; cross-entropy per block
  position with weights exp(-(j-1)/gamma), since early positions decide the acceptance length.

Owns: batching (padding), the losses and their validation metrics. Ignores: optimisation and data making.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lab.drafters.dflash import DFlashDrafter, block_mask
from lab.drafters.eagle import EagleDrafter
from lab.kv_cache.base import NoCache
from lab.models.decoder import DecoderModel
from lab.training.data import Sequence


@dataclass(slots=True)
class Batch:
    token_ids: torch.Tensor      # (S, T) padded with 0
    features: torch.Tensor       # (S, T, F) fp32
    lengths: torch.Tensor        # (S,)
    prompt_lens: torch.Tensor    # (S,)


def make_batch(sequences: list[Sequence], features: list[torch.Tensor], max_len: int) -> Batch:
    lengths = [min(len(s.token_ids), max_len) for s in sequences]
    longest = max(lengths)
    ids = torch.zeros(len(sequences), longest, dtype=torch.long)
    feats = torch.zeros(len(sequences), longest, features[0].shape[-1])
    for row, (seq, feat, n) in enumerate(zip(sequences, features, lengths)):
        ids[row, :n] = torch.tensor(seq.token_ids[:n])
        feats[row, :n] = feat[:n].float()
    return Batch(ids, feats, torch.tensor(lengths), torch.tensor([min(s.prompt_len, n) for s, n in zip(sequences, lengths)]))


def _logits(target: DecoderModel, hidden: torch.Tensor) -> torch.Tensor:
    return target.compute_logits(target.norm(hidden)).float()


def eagle_loss(drafter: EagleDrafter, target: DecoderModel, batch: Batch, ce_weight: float = 0.1,
               noise: float = 0.1, ce_positions: int = 128, generator: torch.Generator | None = None
               ) -> tuple[torch.Tensor, dict[str, float]]:
    s, t = batch.token_ids.shape
    with torch.no_grad():   # EAGLE's features are the target's last hidden states after the final norm
        features = target.norm(batch.features)                                    # (S, T, H)
    prev = torch.cat((features.new_zeros(s, 1, features.shape[-1]), features[:, :-1]), dim=1)
    if noise and drafter.training:
        prev = prev + (torch.rand(prev.shape, generator=generator) - 0.5) * 2 * noise
    positions = torch.arange(t)[None].expand(s, t)
    with torch.no_grad():
        embeds = target.embed_tokens(batch.token_ids)
    predicted = drafter(embeds, prev, positions, NoCache())                        # (S, T, H)
    valid = torch.arange(t)[None] < batch.lengths[:, None]                         # (S, T)
    regression = (F.smooth_l1_loss(predicted, features, reduction="none").mean(-1) * valid).sum() / valid.sum()
    # NOTE: the head's cross-entropy at a sample of answer positions i (predicting token i + 1): the LM head
    # is 49k wide, so every position would dominate the step's cost for little gain.
    rows, cols = [], []
    for row in range(s):
        candidates = torch.arange(max(0, int(batch.prompt_lens[row]) - 1), int(batch.lengths[row]) - 1)
        pick = candidates[torch.randperm(len(candidates), generator=generator)[:ce_positions]]
        rows.append(torch.full_like(pick, row))
        cols.append(pick)
    rows, cols = torch.cat(rows), torch.cat(cols)
    logits = target.compute_logits(predicted[rows, cols]).float()                  # (P, V)
    labels = batch.token_ids[rows, cols + 1]
    ce = F.cross_entropy(logits, labels)
    accuracy = (logits.argmax(-1) == labels).float().mean()
    return regression + ce_weight * ce, {"regression": regression.item(), "ce": ce.item(),
                                         "top1_acc": float(accuracy)}


def sample_anchors(batch: Batch, num_anchors: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """(S, M) anchor positions in each answer (a block predicts tokens anchor+1 .. anchor+B-1)."""
    anchors = []
    for length, prompt_len in zip(batch.lengths.tolist(), batch.prompt_lens.tolist()):
        low, high = max(1, prompt_len - 1), max(1, length - 2)
        anchors.append(torch.randint(low, max(low + 1, high + 1), (num_anchors,), generator=generator))
    return torch.stack(anchors)


def dflash_loss(drafter: DFlashDrafter, target: DecoderModel, batch: Batch, num_anchors: int = 16,
                gamma: float = 7.0, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    s, t = batch.token_ids.shape
    block = drafter.block_size
    anchors = sample_anchors(batch, num_anchors, generator)                        # (S, M)
    offsets = torch.arange(block)
    block_positions = (anchors[..., None] + offsets).reshape(s, -1)                # (S, M*B)
    label_positions = block_positions.clamp(max=t - 1)
    labels = batch.token_ids.gather(1, label_positions)
    labels[(block_positions >= batch.lengths[:, None])] = -100
    labels = labels.view(s, num_anchors, block)[:, :, 1:]                          # (S, M, B-1)
    context = drafter.context_kv(batch.features, torch.arange(t)[None].expand(s, t))
    with torch.no_grad():
        first = target.embed_tokens(batch.token_ids.gather(1, anchors))            # (S, M, H)
    last = batch.features.gather(1, (anchors - 1)[..., None].expand(-1, -1, batch.features.shape[-1]))
    hidden = drafter(drafter.block_inputs(first, last), block_positions, context,
                     block_mask(batch.lengths, anchors, t, block))                  # (S, M*B, H)
    hidden = hidden.view(s, num_anchors, block, -1)[:, :, 1:]
    keep = labels >= 0
    logits = _logits(target, hidden[keep])                                          # (P, V)
    weights = torch.exp(-(offsets[1:].float() - 1) / gamma).expand_as(labels)[keep]
    ce = (F.cross_entropy(logits, labels[keep], reduction="none") * weights).sum() / weights.sum()
    correct = torch.zeros_like(labels, dtype=torch.bool)
    correct[keep] = logits.argmax(-1) == labels[keep]
    # NOTE: greedy acceptance length of each block = 1 + the run of correct predictions from its start.
    accepted = torch.cumprod(correct.float(), dim=-1).sum(-1)                      # (S, M)
    return ce, {"ce": ce.item(), "top1_acc": float(correct[keep].float().mean()),
                "acceptance_length": float(1 + accepted.mean())}


def cosine_lr(step: int, total: int, warmup: int, peak: float) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))
