"""A drafter training run: build the drafter for the target (its layers initialised from the target's
last layers), load the cached data and features, optimise (AdamW, warm-up + cosine), validate on held-out
sequences, save the best validated weights (the starting ones included: a fine-tune that only hurts keeps its
checkpoint's) with the command that re-creates them. SIGINT / SIGTERM (Ctrl-C, `kill`) stop the
run after its current step and save the best validated weights so far, their command ending in
`train.stop_after=<steps done>` so that it still re-creates them; `train.max_seconds` stops a run the same way.

Owns: the optimisation loop and the train/validation split. Ignores: the objectives (losses.py) and
where data comes from (data.py).
"""

from __future__ import annotations

import difflib
import json
import math
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab.config_check import check_call
from lab.drafters.checkpoint import load_drafter, read_checkpoint, resolve_checkpoint, save_drafter, target_fingerprint
from lab.drafters.dflash import DFlashConfig, DFlashDrafter
from lab.drafters.eagle import EagleConfig, EagleDrafter
from lab.errors import LabError
from lab.logging import NullLogger
from lab.models.decoder import DecoderModel
from lab.models.sources import default_cache_dir
from lab.runner import ModelRunner
from lab.training.data import DataConfig, FeatureFn, load_corpus, online_features
from lab.training.losses import Batch, cosine_lr, dflash_loss, eagle_loss, make_batch
from lab.training.precision import MATMUL_PRECISIONS, effective_precision, float32_matmul_precision


@dataclass(slots=True)
class TrainConfig:
    steps: int = 600
    batch_size: int = 4
    lr: float = 5e-4
    warmup_steps: int = 30
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    seed: int = 0
    max_seq_len: int = 512
    val_sequences: int = 12
    log_every: int = 20
    val_every: int = 100   # validate every N steps and keep the best weights, the starting ones included (early
                           # stopping); 0 = only at the end
    init_from: str | None = None   # a drafter checkpoint to go on training (its config wins over the drafter options)
    add_layers: int = 0            # DFlash with init_from: append this many layers that start as the identity
    stop_after: int | None = None  # end after this many steps of the `steps`-long schedule (an interrupted run's record)
    max_seconds: float | None = None   # end once training has run this long (a leased GPU's budget), as a signal does
    # the matrix products of the target's features and the drafter's training: highest (full fp32), high (TF32
    # tensor cores on CUDA: a 10-bit mantissa, several times the rate; fp32 on a CPU), medium (bf16 inputs, fp32
    # sums: on CUDA, and on a CPU with AMX or AVX512-BF16); the target's answers are generated before, in full fp32
    # (lab/training/precision.py)
    matmul_precision: str = "highest"

    def __post_init__(self) -> None:
        """Ranges the training loop relies on, checked before the target loads (a 0 would divide or train nothing)."""
        for name, low in (("steps", 1), ("batch_size", 1), ("log_every", 1), ("max_seq_len", 2), ("val_sequences", 1),
                          ("warmup_steps", 0), ("val_every", 0), ("add_layers", 0)):
            value = getattr(self, name)
            if value < low:
                raise LabError(f"train.{name} must be >= {low}, got {value}", f"set train.{name} to {low} or more")
        if self.max_seconds is not None and not self.max_seconds > 0:
            raise LabError(f"train.max_seconds must be > 0, got {self.max_seconds}", "drop it or set a time budget")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise LabError(f"train.matmul_precision must be one of {', '.join(MATMUL_PRECISIONS)}, "
                           f"got {self.matmul_precision!r}", "e.g. train.matmul_precision=high (TF32 on a GPU)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise LabError(f"train.lr must be a finite number > 0, got {self.lr}", "e.g. train.lr=5e-4")


# DFlash layer weight -> the target decoder layer's weight of the same shape (a warm start)
_DFLASH_TO_TARGET = {"qkv_proj.weight": "self_attn.qkv_proj.weight", "o_proj.weight": "self_attn.o_proj.weight"}


def init_from_target(drafter: nn.Module, target: DecoderModel, identity: bool = False) -> None:
    """Copy the target's last layers into the drafter's layers where shapes agree (a warm start); then start
    from a drafter that repeats the target's own prediction one position early: EAGLE always, DFlash when
    `identity` (drafter.start_as_identity) and it reads the features before its block, the last layer's among them."""
    if isinstance(drafter, EagleDrafter):
        pairs = [(drafter.layer, target.layers[-1])]
        names = {}
    else:
        with torch.no_grad():   # the mask token starts at the scale of a real token's embedding
            drafter.mask_embedding.copy_(torch.randn_like(drafter.mask_embedding) * target.embed_tokens.weight.std())
        pairs = list(zip(drafter.layers, list(target.layers)[-len(drafter.layers):]))
        names = _DFLASH_TO_TARGET
    for mine, theirs in pairs:
        _copy_matching(mine, theirs, names)
    if isinstance(drafter, EagleDrafter):
        start_as_identity(drafter)
    elif identity and drafter.reads_last_context and len(target.layers) - 1 in drafter.feature_layers:
        start_dflash_as_identity(drafter, target)


def _copy_matching(mine: nn.Module, theirs: nn.Module, names: dict[str, str]) -> None:
    """Copy `theirs`' weights into `mine` wherever a name (mapped through `names`) and shape agree."""
    source = theirs.state_dict()
    state = mine.state_dict()
    for name, tensor in state.items():
        value = source.get(names.get(name, name))
        if value is not None and value.shape == tensor.shape:
            state[name] = value.detach().clone().float()
    mine.load_state_dict(state)


def start_as_identity(drafter: EagleDrafter) -> None:
    """EAGLE starts out predicting feature i = feature i-1: the input projection passes the feature half
    through and the layer's two residual branches (o_proj, down_proj) start at zero. Training then learns
    corrections from the new token's embedding, from a sane first guess (the target's own next-token
    distribution one position early) instead of from garbage, which cost the first hundreds of steps."""
    with torch.no_grad():
        hidden = drafter.fc.out_features
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, hidden:].copy_(torch.eye(hidden))
        drafter.layer.self_attn.o_proj.weight.zero_()
        drafter.layer.mlp.down_proj.weight.zero_()


def start_dflash_as_identity(drafter: DFlashDrafter, target: DecoderModel) -> None:
    """DFlash's counterpart of EAGLE's identity start: the context stream starts as the target's own final norm
    of its last layer's state (the other layers' columns at zero) and the layers' residual branches at zero, so
    every block position first outputs the target's distribution at the position before the block. After 100
    steps it had 10 % top-1 at offset 1 where the same drafter from a random projection had 5 %."""
    hidden = target.norm.weight.shape[0]
    column = drafter.feature_layers.index(len(target.layers) - 1) * hidden
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, column:column + hidden].copy_(torch.eye(hidden))
        drafter.context_norm.weight.copy_(target.norm.weight)
        if drafter.input_fc is not None:   # the context half passes through; the token's half starts at zero
            drafter.input_fc.weight.zero_()
            drafter.input_fc.weight[:, hidden:].copy_(torch.eye(hidden))
        for layer in drafter.layers:
            _zero_residual_branches(layer)


def _zero_residual_branches(layer: nn.Module) -> None:
    """A DFlash layer that passes its input through: attention and MLP outputs start at zero."""
    with torch.no_grad():
        layer.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def deepen_dflash(drafter: nn.Module, count: int, target: DecoderModel, hf_config: object | None = None
                  ) -> DFlashDrafter:
    """A trained DFlash drafter with `count` more layers on top that start as the identity (their residual
    branches at zero, the rest warm-started from the target's last layers), so the deeper drafter first drafts
    exactly what the trained one did. Why: in one layer, every block position attends only to the block's
    inputs (the first token and masks), so offset 2 can never see what the drafter guessed at offset 1; a layer
    on top attends to the first layer's outputs, each of which carries its offset's guess."""
    if not isinstance(drafter, DFlashDrafter):
        raise LabError(f"train.add_layers deepens DFlash drafters, not {type(drafter).__name__}",
                       "drop train.add_layers (EAGLE drafts with one layer)")
    if count < 0:
        raise LabError(f"train.add_layers must be >= 0, got {count}", "set train.add_layers to 0 or more")
    deeper = DFlashDrafter(target.config, replace(drafter.config, num_layers=drafter.config.num_layers + count),
                           hf_config)
    missing, unexpected = deeper.load_state_dict(drafter.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("layers.") for name in missing), (missing, unexpected)
    new_layers = list(deeper.layers)[drafter.config.num_layers:]
    for mine, theirs in zip(new_layers, list(target.layers)[-count:]):
        _copy_matching(mine, theirs, _DFLASH_TO_TARGET)
        _zero_residual_branches(mine)
    return deeper.to(next(drafter.parameters()).dtype)


# NOTE: the `drafter=` options that shape a new drafter (its EagleConfig / DFlashConfig), and those the recipe reads
SHAPE_OPTIONS = {"eagle": ("feature_layer", "intermediate_size"),
                 "dflash": ("block_size", "num_layers", "feature_layers", "intermediate_size", "fuse_last_context",
                            "mask_per_position", "input_fusion")}
RECIPE_OPTIONS = {"eagle": ("start_as_identity", "ce_weight", "noise", "ce_positions", "draft_vocab_size"),
                  "dflash": ("start_as_identity", "anchors_per_seq", "gamma", "greedy_path", "max_fill",
                             "fill_weights", "draft_vocab_size")}


def check_drafter_options(kind: str, options: dict[str, Any]) -> None:
    """The drafter kind is known, every `drafter=` option is one the drafter or the recipe reads, and the drafter's
    own options are of their fields' types."""
    if kind not in SHAPE_OPTIONS:
        raise LabError(f"unknown drafter {kind!r}", "use drafter=eagle or drafter=dflash")
    known = SHAPE_OPTIONS[kind] + RECIPE_OPTIONS[kind]
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise LabError(f"drafter has no option {key!r} (the {kind} drafter and its recipe take: "
                           f"{', '.join(known)})",
                           f"did you mean drafter.{close[0]}?" if close else f"remove drafter.{key}")
    config = {"eagle": EagleConfig, "dflash": DFlashConfig}[kind]
    check_call(config, {k: v for k, v in options.items() if k in SHAPE_OPTIONS[kind]}, "drafter")
    if kind == "dflash":
        _check_fill_weights(options.get("fill_weights"), options.get("max_fill", 0))


def build_drafter(kind: str, target: ModelRunner, options: dict[str, Any]) -> nn.Module:
    settings = {k: (list(v) if k == "feature_layers" else v) for k, v in options.items() if k in SHAPE_OPTIONS[kind]}
    if kind == "eagle":
        return EagleDrafter(target.config, EagleConfig(**settings), target.source.hf_config)
    return DFlashDrafter(target.config, DFlashConfig(**settings), target.source.hf_config)


def train_drafter(kind: str, target: ModelRunner, data: DataConfig, train: TrainConfig, options: dict[str, Any],
                  output: Path, command: str, cache_dir: Path | None = None,
                  log: Callable[[str], None] = print, logger: Any = None) -> dict[str, float]:
    """Train, validate, save `output`; `log` takes the progress lines, `logger` (lab.logging, started by the
    caller) the curves: series `train` (loss, lr, the objective's metrics) and `val`, keyed by step, then the
    final metrics as its summary and the checkpoint as an artifact."""
    logger = logger or NullLogger()
    check_drafter_options(kind, options)
    if train.stop_after is not None and train.stop_after < 1:
        raise LabError(f"train.stop_after must be >= 1, got {train.stop_after}", "drop it or set a step count")
    if target.dtype != torch.float32:
        raise LabError(f"drafter training runs in float32, the target is {target.dtype}", "set model.dtype=float32")
    torch.manual_seed(train.seed)
    generator = torch.Generator().manual_seed(train.seed)
    if train.init_from:
        # NOTE: fine-tuning: the checkpoint fixes the drafter's shape; its command comes first in the new one, so
        # the recorded command still re-creates the weights from nothing.
        path = resolve_checkpoint(train.init_from)
        drafter = load_drafter(path, kind, target.model, target.source.hf_config).float()
        command = f"{read_checkpoint(path)['command']} && {command}"
        if train.add_layers:
            drafter = deepen_dflash(drafter, train.add_layers, target.model, target.source.hf_config)
    elif train.add_layers:
        raise LabError("train.add_layers deepens a trained drafter", "set train.init_from=<a dflash checkpoint>")
    else:
        drafter = build_drafter(kind, target, options).to(target.device, torch.float32)
        init_from_target(drafter, target.model, bool(options.get("start_as_identity", False)))
    if kind == "dflash":   # NOTE: a fine-tuned drafter keeps what it was trained to take filled before
        if not 0 <= options.get("max_fill", 0) <= drafter.block_size - 2:
            raise LabError(f"drafter.max_fill must be in 0..{drafter.block_size - 2} (block size - 2), "
                           f"got {options['max_fill']}", "set drafter.max_fill to the denoising steps wanted - 1")
        drafter.config = replace(drafter.config, max_fill=max(drafter.config.max_fill, options.get("max_fill", 0)))
    drafter = drafter.to(target.device)   # NOTE: batches are built on the CPU (the cached features) and moved here
    target_model = target.model.float().eval()
    for p in target_model.parameters():
        p.requires_grad_(False)
    data.feature_layers = tuple(drafter.feature_layers)
    cache_dir = cache_dir or default_cache_dir() / "train" / target_fingerprint(target_model)
    precision, why = effective_precision(train.matmul_precision, target.device)
    if why:
        log(why)
    parts = load_corpus(target, data, cache_dir, log, precision)   # features None: data.features=online
    for part in parts:
        if len(part.sequences) <= train.val_sequences:
            raise LabError(f"only {len(part.sequences)} training sequences of {part.name}",
                           "raise its num_prompts (data.num_prompts, or the data.mix entry's)")
    online = parts[0].features is None
    compute = online_features(target, data.feature_layers) if online else None
    # NOTE: every part's first answers validate (its own held-out set); the rest train.
    vals = [(p.name, (p.sequences[:train.val_sequences], None if online else p.features[:train.val_sequences]))
            for p in parts]
    sequences = [s for p in parts for s in p.sequences[train.val_sequences:]]
    features = None if online else [f for p in parts for f in p.features[train.val_sequences:]]
    draw = _sampler([len(p.sequences) - train.val_sequences for p in parts], [p.share for p in parts], generator)
    val_weights = [p.share or len(p.sequences) for p in parts]
    loss_fn = _objective(kind, options, target_model)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=train.lr,
                                  weight_decay=train.weight_decay, betas=(0.9, 0.95))
    log(f"training {kind}: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f} M parameters, "
        f"{len(sequences)} sequences ({sum(len(s.token_ids) for s in sequences)} tokens), {train.steps} steps")
    validate = lambda: evaluate_parts(drafter, loss_fn, vals, val_weights, train.max_seq_len, compute)   # noqa: E731
    with float32_matmul_precision(precision):
        before = validate()
        log(f"step 0 validation {json.dumps(before)}")
        logger.log_series("val", [{"step": 0, **before}], "step")
        start = time.perf_counter()
        drafter.train()
        losses: list[float] = []
        # NOTE: the starting weights are a candidate too: a fine-tune (train.init_from) that only hurts keeps them
        best = _Best(0, before, _state_copy(drafter))
        steps_done = train.steps if train.stop_after is None else min(train.steps, train.stop_after)
        stop = _StopEarly(train.max_seconds)
        for step in stop.steps(steps_done):
            index = draw(train.batch_size)
            chosen = None if features is None else [features[i] for i in index]
            batch = make_batch([sequences[i] for i in index], chosen, train.max_seq_len, target.device, compute)
            for group in optimizer.param_groups:
                group["lr"] = cosine_lr(step, train.steps, train.warmup_steps, train.lr)
            loss, metrics = loss_fn(drafter, batch, generator)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(drafter.parameters(), train.grad_clip)
            optimizer.step()
            losses.append(loss.item())
            if (step + 1) % train.log_every == 0 or step == 0:
                log(f"step {step + 1}/{train.steps} loss {losses[-1]:.4f} {json.dumps(_round(metrics))} "
                    f"({time.perf_counter() - start:.0f} s)")
                logger.log_series("train", [{"step": step + 1, "loss": losses[-1],
                                             "lr": optimizer.param_groups[0]["lr"],
                                             "seconds": time.perf_counter() - start, **metrics}], "step")
            if train.val_every and (step + 1) % train.val_every == 0 and step + 1 < steps_done:
                best = _keep_best(best, step + 1, validate(), drafter, log, logger)
        # NOTE: the recorded command counts steps, not seconds (a slower machine would stop elsewhere), and ends
        # where this run did, so it still re-creates these weights
        earlier, _, last = command.rpartition(" && ")
        last = re.sub(r"\s*train\.max_seconds=\S+", "", last)
        if stop.reason:
            steps_done = stop.steps_done
            log(f"{stop.reason}: stopped after step {steps_done} of {train.steps}; saving the best weights so far")
            last = re.sub(r"\s*train\.stop_after=\S+", "", last) + f" train.stop_after={steps_done}"
        command = f"{earlier} && {last}" if earlier else last
        best = _keep_best(best, steps_done, validate(), drafter, log, logger)
        drafter.load_state_dict(best.state)
        after = best.metrics
    kept = "the starting weights (no validated step improved on them)" if best.step == 0 else \
        f"the weights of step {best.step}"
    log(f"kept {kept}: validation {json.dumps(after)}")
    window = max(1, min(10, len(losses) // 4))
    metrics = {"train_seconds": time.perf_counter() - start, "steps": steps_done, "best_step": best.step,
               "train/first_loss": sum(losses[:window]) / window, "train/last_loss": sum(losses[-window:]) / window,
               **{f"val_before/{k}": v for k, v in before.items()}, **{f"val/{k}": v for k, v in after.items()}}
    save_drafter(output, drafter.eval(), target_model, command, metrics)
    log(f"saved {output} ({output.stat().st_size / 1e6:.1f} MB)")
    logger.log_summary(metrics)
    logger.log_artifact(output, f"{kind}-{output.stem}", kind="model")
    return metrics


Objective = Callable[[nn.Module, Batch, torch.Generator], tuple[torch.Tensor, dict[str, float]]]


def _objective(kind: str, options: dict[str, Any], target: DecoderModel) -> Objective:
    if kind == "eagle":
        return lambda drafter, batch, generator: eagle_loss(
            drafter, target, batch, options.get("ce_weight", 0.1), options.get("noise", 0.1),
            options.get("ce_positions", 128), generator, options.get("draft_vocab_size", 0))
    weights = options.get("fill_weights")
    fill_weights = None if weights is None else tuple(float(w) for w in weights)
    return lambda drafter, batch, generator: dflash_loss(
        drafter, target, batch, options.get("anchors_per_seq", 16), options.get("gamma", 7.0), generator,
        options.get("draft_vocab_size", 0), greedy_path=options.get("greedy_path", True),
        max_fill=options.get("max_fill", 0), fill_weights=fill_weights)


def _check_fill_weights(weights: Any, max_fill: int) -> None:
    """drafter.fill_weights: null, or max_fill + 1 numbers >= 0 (the relative shares of blocks given 0, 1, ..,
    max_fill offsets), not all 0."""
    if weights is None:
        return
    fix = (f"set drafter.fill_weights to {max_fill + 1} weights for 0..{max_fill} given offsets, e.g. "
           f"[{','.join(['2'] + ['1'] * max_fill)}], or to null (uniform)")
    if not max_fill:
        raise LabError("drafter.fill_weights weighs how many offsets a block is given, but drafter.max_fill is 0",
                       "set drafter.max_fill >= 1, or drop drafter.fill_weights")
    if isinstance(weights, (str, bytes)) or not hasattr(weights, "__len__"):
        raise LabError(f"drafter.fill_weights must be a list, got {weights!r}", fix)
    if len(weights) != max_fill + 1:
        raise LabError(f"drafter.fill_weights has {len(weights)} weights, drafter.max_fill={max_fill} needs "
                       f"{max_fill + 1} (for 0..{max_fill} given offsets)", fix)
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
               for w in weights) or not sum(weights) > 0:
        raise LabError(f"drafter.fill_weights must be finite numbers >= 0, not all 0, got {list(weights)}", fix)


def _sampler(sizes: list[int], shares: list[float | None], generator: torch.Generator) -> Callable[[int], list[int]]:
    """count -> indices into the parts' training sequences laid end to end: uniform over all of them (shares
    None), or each draw from a part picked by its share, then uniform within it."""
    if shares[0] is None:
        return lambda count: torch.randint(sum(sizes), (count,), generator=generator).tolist()
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    weights = torch.tensor(shares, dtype=torch.float64)

    def draw(count: int) -> list[int]:
        picked = torch.multinomial(weights, count, replacement=True, generator=generator).tolist()
        return [starts[p] + int(torch.randint(sizes[p], (1,), generator=generator)) for p in picked]

    return draw


def evaluate_parts(drafter: nn.Module, loss_fn: Objective, vals: list[tuple[str, tuple[list, list | None]]],
                   weights: list[float], max_len: int,
                   compute_features: FeatureFn | None = None) -> dict[str, float]:
    """`evaluate` on each part's validation set; with several parts, their mean by `weights` (the training draws'
    mixture) and every part's own metrics as `<part>/<metric>`."""
    if len(vals) == 1:
        return evaluate(drafter, loss_fn, vals[0][1], max_len, compute_features)
    each = {name: evaluate(drafter, loss_fn, val, max_len, compute_features) for name, val in vals}
    total = sum(weights)
    mean = {k: sum(w * metrics[k] for w, metrics in zip(weights, each.values())) / total for k in each[vals[0][0]]}
    return _round(mean) | {f"{name}/{k}": v for name, metrics in each.items() for k, v in metrics.items()}


@torch.no_grad()
def evaluate(drafter: nn.Module, loss_fn: Objective, val: tuple[list, list | None], max_len: int,
             compute_features: FeatureFn | None = None) -> dict[str, float]:
    """Mean validation metrics over held-out sequences, batches of 4, the same anchors every time (features None:
    `compute_features` computes them, data.features=online)."""
    drafter.eval()
    sequences, features = val
    device = next(drafter.parameters()).device
    totals: dict[str, float] = {}
    batches = 0
    generator = torch.Generator().manual_seed(1234)
    for i in range(0, len(sequences), 4):
        batch = make_batch(sequences[i:i + 4], None if features is None else features[i:i + 4], max_len, device,
                           compute_features)
        _, metrics = loss_fn(drafter, batch, generator)
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
        batches += 1
    drafter.train()
    return _round({k: v / batches for k, v in totals.items()})


class _StopEarly:
    """The training steps, until SIGINT or SIGTERM or `max_seconds` after the first: the reason is noted (`reason`,
    `steps_done`) and the loop ends after its current step, so the run can save what it has; a second signal
    interrupts at once. Signal handlers are the main thread's: elsewhere only the time limit applies."""

    clock = staticmethod(time.perf_counter)   # NOTE: the time limit's clock (a test's to replace)

    def __init__(self, max_seconds: float | None = None) -> None:
        self.max_seconds = max_seconds
        self.reason: str | None = None
        self.steps_done = 0

    def steps(self, count: int) -> Iterator[int]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            previous = {number: signal.signal(number, self._receive) for number in (signal.SIGINT, signal.SIGTERM)}
        deadline = None if self.max_seconds is None else self.clock() + self.max_seconds
        try:
            for step in range(count):
                if deadline is not None and self.clock() >= deadline and not self.reason:
                    self.reason = f"train.max_seconds={self.max_seconds:g}"
                if self.reason:
                    return
                yield step
                self.steps_done = step + 1
        finally:
            for number, handler in previous.items():
                signal.signal(number, handler)

    def _receive(self, number: int, _frame: object) -> None:
        if self.reason is not None:
            raise KeyboardInterrupt
        self.reason = signal.Signals(number).name


@dataclass(slots=True)
class _Best:
    step: int
    metrics: dict[str, float]
    state: dict[str, torch.Tensor]


def _keep_best(best: _Best, step: int, metrics: dict[str, float], drafter: nn.Module,
               log: Callable[[str], None], logger: Any) -> _Best:
    """Early stopping on the validation cross-entropy (a small corpus overfits within a few epochs)."""
    log(f"step {step} validation {json.dumps(metrics)}")
    logger.log_series("val", [{"step": step, **metrics}], "step")
    if metrics["ce"] < best.metrics["ce"]:
        return _Best(step, metrics, _state_copy(drafter))
    return best


def _state_copy(drafter: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in drafter.state_dict().items()}


def _round(metrics: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 4) for k, v in metrics.items()}
