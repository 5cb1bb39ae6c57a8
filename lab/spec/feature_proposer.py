"""FeatureProposer: what the EAGLE and DFlash proposers share. A trained drafter (from its checkpoint, or
random-init for tests) that reads the target's features, which the engine hands over after every target
forward (`observe`), and the target's frozen embedding, final norm and LM head.

The head may be cut to a draft vocabulary (`draft_vocab_size`, as EAGLE-3's smaller draft vocabulary): only
the first N token ids get draft logits, the rest -inf. A byte-level BPE tokenizer numbers its tokens in
merge order, which follows their frequency, so the first ids are the common ones (SmolLM2: the first
8192 of 49152 cover 88 % of its MT-Bench answer tokens, 16384 cover 94.5 %; docs/speculative.md). The
drafter then never proposes a rarer token, a proposal the target would have to confirm anyway; the
verification and so the output are unchanged (q is 0 outside the draft vocabulary, which rejection
sampling handles like any other q).

At batch 1 a drafter step is a few matrix-vector products whose cost is the bytes of weight they stream
(its layer and the draft head: ~36 MB in fp32 for smollm2's EAGLE). `weights` picks what they stream
(resolve_draft_weights): `fp16` copies (fp32 arithmetic; the checkpoint is stored in fp16, so the drafter's own
weights lose nothing; the head's logits move by ~1e-3 of their spread), or `q8_0` blocks (1.06 bytes a weight:
the head's are the target's own Q8_0 blocks, exact; the drafter's are its fp16 weights rounded to Q8_0, ~0.2 %
of a block's largest weight), which on AMX tiles serve a drafter's whole block for about the price of one row, or
`q4_1` blocks (0.625 bytes a weight), or `int8`: Q8_0 blocks multiplied in 8-bit integers with each input row
rounded to int8 per 32 columns (native_head.Int8Weight; AVX-512 VNNI, 64 byte products an instruction against an
fp32 FMA's 16, so a block of rows costs about what its bytes take to arrive: the default on such CPUs without AMX).
The draft head streams as the drafter unless `head_weights` says otherwise (resolve_head_weights). Any of them can
only change which token is drafted, never the output.

A ConfidenceGate (`min_confidence`, `always_draft`) drafts only while the product of the drafter's confidences
(its distribution's largest probability at each position) stays at or above it, as suffix decoding does with
its counts: a draft the drafter itself doubts costs a verify row and, for EAGLE, a drafter step, for little
chance of a token.

Owns: building the drafter for a target, the FeatureStore, turning drafter hidden states into tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from lab.drafters.checkpoint import load_drafter, resolve_checkpoint
from lab.errors import LabError
from lab.kv_cache.manager import KVCacheManager
from lab.models import native_head
from lab.models.packed_linear import (can_pack, move_streamed_weights_to_huge_pages, pack_linear_weights,
                                     use_draft_blocks, use_half_weights, use_int8_weights)
from lab.request import Request, SamplingParams
from lab.sample.sampler import argmax_rows
from lab.runner import ModelRunner
from lab.spec.features import FeatureStore
from lab.spec.proposer import pick_draft_tokens

MAX_TREE_WIDTH = 8   # NOTE: candidates a tree node may have; the engine checks the whole tree's size
DraftWeights = Literal["auto", "fp32", "fp16", "q8_0", "q4_1", "int8"]
DRAFT_WEIGHTS: tuple[DraftWeights, ...] = ("auto", "fp32", "fp16", "q8_0", "q4_1", "int8")


def resolve_draft_weights(weights: str, target: ModelRunner) -> DraftWeights:
    """engine.proposer.weights -> what the drafter's few-row products stream: `auto` is `q8_0` where the target's
    blocks run on AMX tiles (model.block_kernel; a drafter's block of rows then costs about one), else `int8` where
    the CPU has AVX-512 VNNI and the target runs on the native kernels (8-bit integer products, 2-3x faster than the
    fp32 ones per linear), else `fp16`."""
    _check_weights("weights", weights, "Q8_0 blocks on AMX tiles, else int8 products where the CPU has AVX-512 "
                   "VNNI, else fp16 copies")
    if weights == "auto":
        if _target_on_tiles(target):
            return "q8_0"
        return "int8" if _int8_runs(target) else "fp16"
    return weights


def _int8_runs(target: ModelRunner) -> bool:
    return can_pack(target.device, target.dtype) and native_head.supported()


def resolve_head_weights(head_weights: str, weights: DraftWeights) -> DraftWeights:
    """engine.proposer.head_weights -> what the draft head's few-row products stream (the target's head cut to the
    draft vocabulary): `auto` is the drafter's own `weights` (resolved; q8_0 streams the target's own Q8_0 head
    blocks, exact). `q4_1` rounds them to Q4_1 (59 % of the bytes): session 41 measured a DFlash draft 3-10 % faster
    and tau 0.01-0.02 lower, no net speedup within run-to-run noise (docs/speculative.md)."""
    _check_weights("head_weights", head_weights, "as engine.proposer.weights")
    return weights if head_weights == "auto" else head_weights


def _check_weights(key: str, value: str, auto_means: str) -> None:
    if value not in DRAFT_WEIGHTS:
        raise LabError(f"engine.proposer.{key}={value!r} is not one of {', '.join(DRAFT_WEIGHTS)}",
                       f"use engine.proposer.{key}=auto ({auto_means}), " + ", ".join(DRAFT_WEIGHTS[1:-1])
                       + f" or {DRAFT_WEIGHTS[-1]}")


def _target_on_tiles(target: ModelRunner) -> bool:
    return bool(target.block_linears) and target.block_kernel == "amx"


def _stream_draft_weights(module: nn.Module, target: ModelRunner, weights: DraftWeights) -> None:
    """Give `module`'s packed linears what their few-row products stream (resolve_draft_weights; `fp32`: their
    own weights), on 2 MiB pages where the target's are (model.huge_pages)."""
    if weights == "fp16":
        use_half_weights(module)
    elif weights in ("q8_0", "q4_1"):
        use_draft_blocks(module, weights, tiles=_target_on_tiles(target))
    elif weights == "int8":
        if not _int8_runs(target):
            raise LabError("engine.proposer.weights=int8 (or head_weights=int8) needs a CPU with AVX-512 VNNI "
                           "and the native kernels built", "use engine.proposer.weights=auto (what this machine runs "
                           "best), fp16 or q8_0, and head_weights=auto")
        use_int8_weights(module)
    if target.use_huge_pages:
        move_streamed_weights_to_huge_pages(module)


def build_drafter(kind: str, target: ModelRunner, checkpoint: str | None, fresh: nn.Module | None,
                  weights: DraftWeights = "fp32") -> nn.Module:
    """The checkpoint's drafter on the target's device and dtype, or `fresh` (random init) when checkpoint is None;
    `weights` (resolve_draft_weights): what its few-row matrix products stream."""
    if checkpoint is None:
        if fresh is None:
            raise LabError(f"proposer={kind} needs a checkpoint", "set engine.proposer.checkpoint")
        drafter = fresh.to(device=target.device, dtype=target.dtype).eval()
    else:
        drafter = load_drafter(resolve_checkpoint(checkpoint), kind, target.model, target.source.hf_config,
                               target.dtype, target.device)
    if can_pack(target.device, target.dtype):
        # NOTE: the target's own fast paths (few-row GEMV, panel GEMM): a drafter forward at batch 1 is a
        # handful of matrix-vector products, which MKL's F.linear streams markedly slower.
        pack_linear_weights(drafter)
        _stream_draft_weights(drafter, target, weights)
    return drafter


def draft_head(target: ModelRunner, draft_vocab_size: int, weights: DraftWeights = "fp32") -> nn.Linear | None:
    """The target's LM head over its first `draft_vocab_size` token ids, sharing the weight (a view of its
    first rows; `weights`: what the GEMV streams, resolve_head_weights); None for the whole vocabulary (0, or
    >= the vocabulary: the target's own head, as the target streams it)."""
    vocab = target.config.vocab_size
    if draft_vocab_size < 0:
        raise LabError(f"engine.proposer.draft_vocab_size must be >= 0 (0: the whole vocabulary), got "
                       f"{draft_vocab_size}", f"e.g. engine.proposer.draft_vocab_size=16384 (of {vocab})")
    if draft_vocab_size == 0 or draft_vocab_size >= vocab:
        return None
    full = target.model.lm_head
    head = nn.Linear(full.in_features, draft_vocab_size, bias=full.bias is not None,
                     device=target.device, dtype=target.dtype)
    head.weight = nn.Parameter(full.weight.detach()[:draft_vocab_size], requires_grad=False)
    if full.bias is not None:
        head.bias = nn.Parameter(full.bias.detach()[:draft_vocab_size], requires_grad=False)
    if can_pack(target.device, target.dtype):
        pack_linear_weights(head)       # NOTE: the target's own fast paths: few-row GEMV, panel GEMM
        _stream_draft_weights(head, target, weights)
    return head.eval()


@dataclass(frozen=True, slots=True)
class ConfidenceGate:
    """Which drafts to keep: while the product of the drafter's confidences (its distribution's largest
    probability at each position) stays >= `min_confidence`; the first `always_draft` positions are kept
    whatever their confidence (their confidences still count in the product). min_confidence 0: all.

    NOTE: lossless with sampling too: a confidence is the maximum of q at that position, which depends only on
    the tokens before it, never on the token drawn there (a rule that looked at the drawn token would bias
    which drafts reach the rejection sampler)."""

    min_confidence: float = 0.0
    always_draft: int = 0
    measure: bool = False   # compute the confidences though nothing is cut by them (engine.draft_policy=goodput)

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_confidence <= 1.0 or self.always_draft < 0:
            raise LabError(f"engine.proposer needs 0 <= min_confidence <= 1 and always_draft >= 0, got "
                           f"{self.min_confidence} and {self.always_draft}",
                           "e.g. min_confidence=0.5 always_draft=1 (min_confidence=0 drafts every position)")

    @property
    def active(self) -> bool:
        """Whether the drafter computes its confidences (to cut drafts by them, or to report them)."""
        return self.min_confidence > 0 or self.measure

    def length(self, confidence: list[float]) -> int:
        """How many leading drafts to keep."""
        product = 1.0
        for length, value in enumerate(confidence):
            product *= value
            if length >= self.always_draft and product < self.min_confidence:
                return length
        return len(confidence)

    def may_extend(self, confidence: list[float]) -> bool:
        """Whether a draft with these confidences, all kept, could keep one more (the product only falls)."""
        return len(confidence) < self.always_draft or math.prod(confidence) >= self.min_confidence


def confidences(logits: torch.Tensor, probs: list[torch.Tensor | None]) -> list[float]:
    """Per row the largest probability of the distribution drafted from: q where sampled, softmax(logits) where
    greedy. logits (R, V), probs: R entries."""
    return [float((q if q is not None else torch.softmax(row, -1)).max()) for row, q in zip(logits, probs)]


class FeatureProposer:
    def __init__(self, target: ModelRunner, drafter: nn.Module, kv: KVCacheManager, draft_vocab_size: int = 0,
                 head_weights: DraftWeights = "fp32", gate: ConfidenceGate | None = None, tree_width: int = 1,
                 tree_min_prob: float = 0.0) -> None:
        if not 1 <= tree_width <= MAX_TREE_WIDTH:
            raise LabError(f"engine.proposer.tree_width must be 1 (a chain of drafts) to {MAX_TREE_WIDTH}, got "
                           f"{tree_width}", "e.g. engine.proposer.tree_width=3: the drafter's 3 best first tokens")
        if not 0.0 <= tree_min_prob <= 1.0:
            raise LabError(f"engine.proposer.tree_min_prob must be in [0, 1], got {tree_min_prob}",
                           "e.g. 0.3: a runner-up joins the tree only where the drafter gives it >= 30 %")
        self.tree_width = tree_width   # candidates for the first drafted position (greedy requests; lab/spec/tree.py)
        self.tree_min_prob = tree_min_prob   # ... each kept only where the drafter's probability of it is >= this
        self.gate = gate or ConfidenceGate()
        self.target = target.model
        self.drafter = drafter
        self.vocab_size = target.config.vocab_size
        self.draft_head = draft_head(target, draft_vocab_size, head_weights)
        self.device, self.dtype = target.device, target.dtype
        self.feature_layers = tuple(i % target.config.num_layers for i in drafter.feature_layers)
        # NOTE: in the target's KV blocks (`kv`: its manager), so prefix-cache hits bring their features along
        self.store = FeatureStore(kv, len(self.feature_layers) * target.config.hidden_size, target.dtype,
                                  target.device)
        self.num_forwards = 0
        self.num_unready = 0   # requests not drafted because some of their features were never computed

    @property
    def drafts_trees(self) -> bool:
        """Whether a greedy request's draft is a tree (several candidates a position), not a chain."""
        return self.tree_width > 1

    def observe(self, slot_mapping: torch.Tensor, features: torch.Tensor) -> None:
        """features (N, F) of one target forward; slot_mapping (N,): the KV slot of each row."""
        self.store.write_slots(slot_mapping, features)

    def ready(self, request: Request) -> bool:
        """Features of every token but the last (the bonus token the target has not run yet) are known."""
        ok = self.store.num_valid(request) >= request.num_tokens - 1
        self.num_unready += not ok
        return ok

    def output_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states (..., H) -> what the head reads: the target's frozen final norm of them."""
        return self.target.norm(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states (..., H) -> logits (..., V) through the target's frozen norm and head."""
        return self.head_logits(self.output_norm(hidden))

    def pick(self, hidden: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
             tree_rows: slice | None = None, width: int = 1
             ) -> tuple[list[int], list[torch.Tensor | None], list[float], list[list[tuple[int, float]]]]:
        """Drafter hidden states (R, H), one row per draft -> (a token per row, its q or None when greedy, the
        drafter's confidence: the largest probability of its distribution there, 1.0 when the gate is off; and,
        for each of the rows `tree_rows` selects when width > 1, that row's candidates if it is greedy: up to `width`
        (token, probability) pairs, best first, those past the first only with probability >= tree_min_prob (else
        [], and no entries without `tree_rows`))."""
        gated = self.gate.active
        width = width if tree_rows is not None else 1
        if self.draft_head is not None and all(p.is_greedy for p in params):
            # NOTE: greedy needs only the draft vocabulary's argmax, not (R, V) logits padded with -inf.
            head = self.head_scores(hidden)                                                  # (R, N)
            tokens, confidence = self.greedy_from_scores(head)
            best = self.kept_candidates(*self.candidates(head[tree_rows], width)) if width > 1 else []
            return (tokens.tolist(), [None] * len(params),
                    confidence.tolist() if confidence is not None else [1.0] * len(params), best)
        logits = self.logits(hidden)                                                         # (R, V)
        tokens, probs = pick_draft_tokens(logits, params, generators)
        best = []
        if width > 1:
            best = [self.kept_candidates(*self.candidates(row[None], width))[0] if p.is_greedy else []
                    for row, p in zip(logits[tree_rows], params[tree_rows])]
        return tokens, probs, confidences(logits, probs) if gated else [1.0] * len(params), best

    @staticmethod
    def candidates(scores: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """scores (..., N) -> the `width` best tokens of each row and their probabilities, (..., width) each. No
        host synchronisation: a CUDA graph can capture it."""
        top = torch.softmax(scores, -1).topk(width, -1)
        return top.indices, top.values

    def kept_candidates(self, tokens: torch.Tensor, probs: torch.Tensor) -> list[list[tuple[int, float]]]:
        """candidates' (R, width) tokens and probabilities -> per row the best (token, probability), then the
        runners-up whose probability reaches tree_min_prob."""
        return [[(token, prob) for rank, (token, prob) in enumerate(zip(row_tokens, row_probs))
                 if rank == 0 or prob >= self.tree_min_prob]
                for row_tokens, row_probs in zip(tokens.tolist(), probs.tolist())]

    def head_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter hidden states (..., H) -> fp32 scores (..., N or V) of the draft vocabulary (or all of it)."""
        normed = self.output_norm(hidden)
        return (self.draft_head(normed) if self.draft_head is not None
                else self.target.compute_logits(normed)).float()

    def greedy_from_scores(self, head: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """head_scores (..., N) -> the greedy draft tokens (...) and, with the gate on, the drafter's largest
        probability at each (...), else None. No host synchronisation: a CUDA graph can capture it."""
        return argmax_rows(head), torch.softmax(head, -1).amax(-1) if self.gate.active else None

    def head_logits(self, normed: torch.Tensor) -> torch.Tensor:
        """Post-norm states (..., H) -> fp32 logits (..., V): the target's head, or the draft vocabulary's
        logits with -inf past it."""
        if self.draft_head is None:
            return self.target.compute_logits(normed).float()
        head = self.draft_head(normed).float()                                               # (..., N)
        logits = head.new_full((*head.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., :head.shape[-1]] = head
        return logits

    def move_positions(self, request_id: str, src: list[int], dst: list[int]) -> None:
        self.store.move(request_id, src, dst)

    def free(self, request_id: str) -> None:
        pass   # NOTE: the features live in the request's KV blocks, which the engine frees

    def reset_history(self) -> None:
        pass   # NOTE: features are per request

    def stats(self) -> dict[str, float]:
        return {"spec/draft_forwards": self.num_forwards, "spec/draft_unready_requests": self.num_unready,
                "spec/feature_store_mb": self.store.nbytes / 2**20}
