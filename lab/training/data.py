"""Training data for drafters: ShareGPT prompts answered by the target itself (greedy, our continuous-
batching engine), optionally more ShareGPT conversations with their recorded answers, then the target's
features on every token, computed once and cached.

The recorded answers (`reference_answers`) cost one prefill each instead of a generation, so they scale
the corpus ~10x for the same time; their text is not the target's, but every training label is (the
losses distil the target's own next-token distribution from its features), so they teach what the
target would say after that context.

The reference features are cached in shards of REFERENCE_SHARD conversations: a count's conversations are
the first of any larger count's (a seeded shuffle), so raising `reference_answers` computes only the new
shards, and an interrupted extraction keeps the shards it finished. Cached features are memory-mapped, so a
corpus larger than RAM trains from the page cache.

`holdout` keeps the first records of the seed-0 shuffle out of every part of the corpus: the prompts a
benchmark workload at the default seed takes, so a drafter trained on a benchmark's own prompt set (GSM8K's
1319 test questions: no other split ships offline) is measured only on questions it never saw.

`mix` adds other datasets' target answers to the corpus, each part cached as its own run's would be (a
GSM8K part reuses the answers and features of `data.dataset=gsm8k` with the same settings), each with an
optional `share` of the training draws: one drafter for both prompt sets instead of one per set.

`features: online` caches no features: the target computes each batch's in the training step
(`online_features`: one batched forward on a GPU, a forward per sequence on a CPU). The cache holds 5 layers x H
values a token (20 GB for smollm2's 3.5M tokens), so on a GPU, where that forward is cheap, a corpus of any size
trains this way; on a CPU it is the cheaper choice while a run draws each sequence about once (a fresh machine
with no cache).

Owns: the caches under $LAB_CACHE/train/<target fingerprint>/ (responses / references JSON, features .pt)
and what is in them. Ignores: the drafters and their losses.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from lab.engines.continuous import ContinuousBatchingEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.kv_cache.base import NoCache
from lab.runner import ModelRunner
from lab.runner.cuda_graphs import CudaGraphConfig
from lab.sched import SchedulerConfig
from lab.training.precision import float32_matmul_precision
from lab.workloads.base import SamplingDefaults
from lab.workloads.dataset_files import load_records
from lab.workloads.datasets import DatasetWorkload, leading_record_ids

REFERENCE_SHARD = 1000   # reference conversations per features file (~1.5 GB for smollm2's 5 DFlash layers)


@dataclass(slots=True)
class DataConfig:
    dataset: str = "sharegpt"
    num_prompts: int = 256
    seed: int = 0
    max_prompt_len: int = 256
    max_new_tokens: int = 256
    max_num_seqs: int = 32
    kv_cache_memory_mb: int = 512          # the generating engine's KV cache (a GPU's batch of 512 wants ~16 GB)
    reference_answers: int = 0             # more conversations with their recorded answers (prefill only)
    holdout: int = 0                       # the first records of the seed-0 shuffle (the benchmark's) never trained on
    features: str = "cached"               # cached: computed once, stored; online: computed per batch (online_features)
    feature_layers: tuple[int, ...] = ()   # filled in by the recipe: the union its drafter reads
    mix: tuple[dict[str, Any], ...] = ()   # more parts: {dataset, num_prompts, holdout?, max_num_seqs?, share?, ...}
    distinct_prompts: bool = False         # drop a part's answers to prompts an earlier part (or itself) already has

    def __post_init__(self) -> None:
        self.mix = tuple(dict(entry) for entry in self.mix)
        _check_mix(self.mix)
        for key in ("num_prompts", "max_prompt_len", "max_new_tokens", "max_num_seqs", "kv_cache_memory_mb"):
            if getattr(self, key) < 1:
                raise LabError(f"data.{key} must be >= 1, got {getattr(self, key)}", f"set data.{key} to a positive integer")
        if self.holdout < 0:
            raise LabError(f"data.holdout must be >= 0, got {self.holdout}",
                           "set data.holdout=0 (none) or the number of benchmark prompts to keep out of training")
        if self.reference_answers < 0:
            raise LabError(f"data.reference_answers must be >= 0, got {self.reference_answers}",
                           "set data.reference_answers=0 (none) or a positive count")
        if self.features not in ("cached", "online"):
            raise LabError(f"unknown data.features {self.features!r}",
                           "use data.features=cached (computed once, stored) or online (computed per batch)")

    def key(self) -> str:
        """The generated answers' cache key (the fields that decide them)."""
        skip = ("feature_layers", "reference_answers", "features", "mix", "kv_cache_memory_mb", "distinct_prompts")
        skip += () if self.holdout else ("holdout",)   # NOTE: caches from before the field keep their keys
        fields = {k: v for k, v in asdict(self).items() if k not in skip}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]

    def reference_key(self) -> str:
        """The reference conversations' cache key (num_prompts: the generated answers' prompts are left out).
        Not the count: the first n conversations are the same for every count >= n."""
        keys = ("dataset", "seed", "num_prompts", "max_prompt_len", "max_new_tokens")
        keys += ("holdout",) if self.holdout else ()
        fields = {k: getattr(self, k) for k in keys}
        return "ref" + hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]

    def parts(self) -> list[tuple[DataConfig, float | None]]:
        """(each part's own data config, its share of the training draws or None): this config without its mix,
        then every mix entry over this config's generation settings (seed, lengths), with no references or
        holdout of its own unless it names them."""
        primary = replace(self, mix=())
        own = {"reference_answers": 0, "holdout": 0}
        extra = [(replace(primary, **(own | {k: v for k, v in entry.items() if k != "share"})), entry.get("share"))
                 for entry in self.mix]
        shares = [share for _, share in extra]
        rest = None if not shares or shares[0] is None else 1.0 - sum(shares)
        return [(primary, rest), *extra]


# NOTE: max_num_seqs is in a part's answer key (the batch changes the kernels, so the greedy answers): a part written
#   at another batch size than the rest (a CPU's 64 beside a GPU's 512) names it to find its cached answers
MIX_KEYS = ("dataset", "num_prompts", "holdout", "reference_answers", "max_prompt_len", "max_new_tokens",
            "max_num_seqs", "share")


def _check_mix(mix: tuple[dict[str, Any], ...]) -> None:
    example = "data.mix=[{dataset:gsm8k,num_prompts:1000,holdout:256,share:0.5}]"
    for entry in mix:
        unknown = sorted(set(entry) - set(MIX_KEYS))
        if unknown or "dataset" not in entry or "num_prompts" not in entry:
            problem = f"unknown keys {unknown}" if unknown else "a part needs a dataset and num_prompts"
            raise LabError(f"data.mix entry {entry}: {problem}", f"give each part some of {list(MIX_KEYS)}: {example}")
    shares = [entry.get("share") for entry in mix]
    if any(share is None for share in shares) and any(share is not None for share in shares):
        raise LabError(f"data.mix: shares {shares} for some parts only",
                       "give every part a share (the main dataset takes the rest) or none (draws in proportion to size)")
    if shares and shares[0] is not None and (min(shares) <= 0 or sum(shares) >= 1):
        raise LabError(f"data.mix: shares {shares} must be > 0 and sum below 1 (the main dataset takes the rest)",
                       "lower the parts' shares")


@dataclass(slots=True)
class Sequence:
    token_ids: list[int]   # prompt + the target's greedy answer
    prompt_len: int


@dataclass(slots=True)
class CorpusPart:
    """One dataset's share of a training corpus (DataConfig.parts)."""
    name: str                                 # its dataset
    sequences: list[Sequence]
    features: list[torch.Tensor] | None       # None: data.features=online
    share: float | None                       # of the training draws; None: in proportion to its size


def held_out_records(config: DataConfig) -> frozenset[str]:
    """The records training never sees: the first data.holdout of the shuffle a workload at seed 0 (conf's
    default) walks, so a drafter trained on a benchmark's own prompt set is measured on prompts it never saw."""
    return leading_record_ids(config.dataset, config.holdout, seed=0) if config.holdout else frozenset()


def generate_responses(runner: ModelRunner, config: DataConfig, cache_dir: Path, log=print) -> list[Sequence]:
    """The target answers `num_prompts` prompts (greedy, up to max_new_tokens, stopping at EOS); cached."""
    path = cache_dir / f"responses-{config.key()}.json"
    if path.is_file():
        return [Sequence(**s) for s in json.loads(path.read_text())]
    workload = DatasetWorkload(config.dataset, num_prompts=config.num_prompts, seed=config.seed,
                               output_len=config.max_new_tokens, max_tokens=config.max_new_tokens,
                               max_prompt_len=config.max_prompt_len, ignore_eos=False,
                               exclude_records=held_out_records(config))
    requests = workload.build(runner.tokenizer, runner.vocab_size, SamplingDefaults())
    # NOTE: on a GPU its decode steps replay CUDA graphs up to the whole batch (auto: off on a CPU)
    sizes = [1 << i for i in range(config.max_num_seqs.bit_length()) if 1 << i < config.max_num_seqs]
    graphs = CudaGraphConfig(capture_sizes=(*sizes, config.max_num_seqs))
    # NOTE: a step's token budget leaves room to admit prompts beside max_num_seqs decodes (512 up to 128 of them)
    scheduler = SchedulerConfig(max_num_seqs=config.max_num_seqs,
                                max_num_batched_tokens=max(512, 4 * config.max_num_seqs))
    engine = ContinuousBatchingEngine(runner, scheduler,
                                      PagedKVCacheConfig(kv_cache_memory_mb=config.kv_cache_memory_mb),
                                      name="train-data", cuda_graphs=graphs)
    start = time.perf_counter()
    result = engine.run(requests)
    tokens = sum(r.num_output_tokens for r in result.requests)
    log(f"generated {tokens} answer tokens for {len(requests)} prompts in {time.perf_counter() - start:.0f} s")
    sequences = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests if r.num_output_tokens > 1]
    store_sequences(path, sequences, log)
    return sequences


def reference_sequences(tokenizer: Any, config: DataConfig, cache_dir: Path, skip: list[Sequence],
                        log=print) -> list[Sequence]:
    """`reference_answers` ShareGPT conversations as prompt (chat template) + recorded answer (first
    max_new_tokens tokens, then EOS), none whose prompt is among `skip`'s; cached."""
    path = cache_dir / f"references-{config.reference_key()}-n{config.reference_answers}.json"
    if path.is_file():
        return [Sequence(**s) for s in json.loads(path.read_text())]
    seen = {tuple(s.token_ids[:s.prompt_len]) for s in skip}
    held_out = held_out_records(config)
    fresh: list[Any] = []
    wanted = config.reference_answers + len(seen)
    while len(fresh) < config.reference_answers:   # more until enough are not among `skip` (prompts repeat)
        workload = DatasetWorkload(config.dataset, num_prompts=wanted, seed=config.seed + 1, max_tokens=None,
                                   max_prompt_len=config.max_prompt_len, exclude_records=held_out)
        try:
            samples = workload.select(tokenizer)
        except LabError as error:
            raise LabError(f"data.reference_answers={config.reference_answers}: {error.problem}",
                           "lower data.reference_answers") from error
        fresh = [s for s in samples if tuple(s.prompt_token_ids) not in seen][:config.reference_answers]
        wanted += config.reference_answers - len(fresh)
    answers = {r["id"]: r["reference"] for r in load_records(config.dataset)}
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    sequences = []
    for sample in fresh:
        answer = tokenizer.encode(answers[sample.record_id], add_special_tokens=False)
        answer = answer[:config.max_new_tokens] if len(answer) > config.max_new_tokens else answer + eos
        sequences.append(Sequence(sample.prompt_token_ids + answer, len(sample.prompt_token_ids)))
    log(f"{len(sequences)} reference conversations, {sum(len(s.token_ids) for s in sequences)} tokens")
    store_sequences(path, sequences, log)
    return sequences


@torch.inference_mode()
def target_features(runner: ModelRunner, sequences: list[Sequence], feature_layers: tuple[int, ...]) -> list[torch.Tensor]:
    """Each sequence's features (T, len(feature_layers) * H), fp16 on CPU: one prefill forward per sequence."""
    out = []
    for seq in sequences:
        ids = torch.tensor(seq.token_ids, dtype=torch.long)[None]                       # (1, T)
        positions = torch.arange(ids.shape[1])[None]
        _, features = runner.execute_with_features(ids, positions, NoCache(), torch.tensor([0]), feature_layers)
        out.append(features[0].to("cpu", torch.float16))
    return out


# token_ids (S, T) padded at the end, each row's length -> the target's features (S, T, F), zeros past each end
FeatureFn = Callable[[torch.Tensor, list[int]], torch.Tensor]


def online_features(runner: ModelRunner, feature_layers: tuple[int, ...], per_row: bool | None = None) -> FeatureFn:
    """data.features=online: token_ids (S, T) on the target's device, padded at the end, and each row's length ->
    their features (S, T, len(feature_layers) * H) fp32, zeros past each row's end. On a GPU one batched causal
    forward over the padded batch (padding after a token cannot change it; one launch beats many); on a CPU, where
    a padded position costs as much arithmetic as a real one, a forward per row over its own tokens (a batch of 16
    ShareGPT conversations is ~half padding). `per_row` chooses one or the other whatever the device."""
    layers = tuple(i % runner.config.num_layers for i in feature_layers)

    @torch.no_grad()   # NOTE: not inference_mode: the features feed the drafter's autograd graph
    def forward(token_ids: torch.Tensor) -> torch.Tensor:                          # (S, T) -> (S, T, F)
        positions = torch.arange(token_ids.shape[1], device=token_ids.device)[None].expand_as(token_ids)
        return runner.model.forward_with_features(token_ids, positions, NoCache(), layers)[1].float()

    def features(token_ids: torch.Tensor, lengths: list[int]) -> torch.Tensor:
        if not (token_ids.device.type == "cpu" if per_row is None else per_row):
            valid = torch.arange(token_ids.shape[1], device=token_ids.device)[None] < torch.tensor(
                lengths, device=token_ids.device)[:, None]                          # (S, T)
            return forward(token_ids) * valid[..., None]
        rows = [forward(token_ids[row:row + 1, :n])[0] for row, n in enumerate(lengths)]   # each (n, F)
        out = rows[0].new_zeros(*token_ids.shape, rows[0].shape[-1])
        for row, (feats, n) in enumerate(zip(rows, lengths)):
            out[row, :n] = feats
        return out

    return features


def load_training_data(runner: ModelRunner, config: DataConfig, cache_dir: Path, log=print,
                       precision: str = "highest") -> tuple[list[Sequence], list[torch.Tensor] | None]:
    """(sequences, their target features at config.feature_layers or None with features=online), from the caches
    when present: the target's own answers first (validation takes the first few), then the reference
    conversations. The answers are generated in fp32; the features computed at `precision` (train.matmul_precision's
    effective setting, lab/training/precision.py), which names their cache unless it is `highest`."""
    answers = generate_responses(runner, config, cache_dir, log)
    references = (reference_sequences(runner.tokenizer, config, cache_dir, answers, log)
                  if config.reference_answers else [])
    if config.features == "online":
        return answers + references, None
    # NOTE: features of reduced-precision products differ from fp32 ones by their rounding: a cache of their own
    tag = "" if precision == "highest" else f"-{precision}"
    features = cached_features(runner, answers, config.key() + tag, config.feature_layers, cache_dir, log, precision)
    for start in range(0, len(references), REFERENCE_SHARD):
        shard = references[start:start + REFERENCE_SHARD]
        key = f"{config.reference_key()}-{start}-{start + len(shard)}{tag}"
        features = features + cached_features(runner, shard, key, config.feature_layers, cache_dir, log, precision)
    return answers + references, features


def load_corpus(runner: ModelRunner, config: DataConfig, cache_dir: Path, log=print,
                precision: str = "highest") -> list[CorpusPart]:
    """Every part of config.parts(), each loaded (and cached) as a run on its own data config would. A prompt
    seen before (in an earlier part, or earlier in the same one) is reported, or dropped with distinct_prompts:
    a part's first answers validate it, so one that another part trains on is not held out."""
    parts = []
    seen: set[tuple[int, ...]] = set()   # the prompts' token ids
    for part, share in config.parts():
        sequences, features = load_training_data(runner, part, cache_dir, log, precision)
        repeats = sum(p.name.split("#")[0] == part.dataset for p in parts)
        name = f"{part.dataset}#{repeats}" if repeats else part.dataset
        fresh = _unseen_prompts(sequences, seen)
        if len(fresh) < len(sequences):
            repeated = len(sequences) - len(fresh)
            if config.distinct_prompts:
                log(f"data: dropped {repeated} of {name}'s {len(sequences)} answers, to prompts seen before")
                sequences = [sequences[i] for i in fresh]
                features = None if features is None else [features[i] for i in fresh]
            else:
                log(f"data: WARNING {repeated} of {name}'s {len(sequences)} prompts were seen before (an earlier "
                    f"part or itself): they train twice, and any among its first answers validate on trained "
                    f"prompts; data.distinct_prompts=true drops them")
        parts.append(CorpusPart(name, sequences, features, share))
    return parts


def _unseen_prompts(sequences: list[Sequence], seen: set[tuple[int, ...]]) -> list[int]:
    """The indices of the sequences whose prompt is not in `seen` nor earlier in `sequences`; adds every prompt."""
    fresh = []
    for i, sequence in enumerate(sequences):
        prompt = tuple(sequence.token_ids[:sequence.prompt_len])
        if prompt not in seen:
            fresh.append(i)
            seen.add(prompt)
    return fresh


def cached_features(runner: ModelRunner, sequences: list[Sequence], key: str, feature_layers: tuple[int, ...],
                    cache_dir: Path, log=print, precision: str = "highest") -> list[torch.Tensor]:
    """The target's features of `sequences` (cached under `key`, memory-mapped when read back) at `feature_layers`,
    computed with torch's float32 matmul precision `precision` where not cached."""
    wanted = [i % runner.config.num_layers for i in feature_layers]
    # NOTE: one cache serves every drafter whose layers it covers (EAGLE's last layer is among DFlash's).
    for path in sorted(cache_dir.glob(f"features-{key}-L*.pt")):
        stored = [int(i) for i in path.stem.split("-L", 1)[1].split("-")]
        if set(wanted) <= set(stored):
            features = torch.load(path, weights_only=True, mmap=True)   # pages in as batches read it
            hidden = runner.config.hidden_size
            columns = torch.cat([torch.arange(stored.index(i) * hidden, (stored.index(i) + 1) * hidden) for i in wanted])
            return [f if stored == wanted else f[:, columns] for f in features]
    start = time.perf_counter()
    with float32_matmul_precision(precision):
        features = target_features(runner, sequences, tuple(wanted))
    log(f"target features for {sum(len(s.token_ids) for s in sequences)} tokens in {time.perf_counter() - start:.0f} s")
    path = cache_dir / f"features-{key}-L{'-'.join(str(i) for i in wanted)}.pt"
    store_in_cache(path, lambda partial: torch.save(features, partial), log)
    return features


def store_sequences(path: Path, sequences: list[Sequence], log=print) -> bool:
    """Cache `sequences` (answers or reference conversations) as JSON at `path` (store_in_cache)."""
    return store_in_cache(path, lambda partial: partial.write_text(json.dumps([asdict(s) for s in sequences])), log)


def store_in_cache(path: Path, write: Callable[[Path], None], log=print) -> bool:
    """`write` the cache file `path` whole or not at all: into a partial file beside it, renamed over `path` once
    complete, so that a run stopped mid-write or a full disk never leaves a truncated file for the next run to load.
    A failed write is logged and the caller goes on with what it holds in memory (the hour of answers or features
    it has just computed is not thrown away for want of a cache); returns whether `path` was stored."""
    partial = path.with_name(path.name + ".partial")   # NOTE: no cache glob (`*.pt`, `*.json`) matches it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(partial)
        os.replace(partial, path)
        return True
    except (OSError, RuntimeError) as error:   # NOTE: torch.save reports a full disk as a RuntimeError
        partial.unlink(missing_ok=True)
        log(f"WARNING: could not cache {path.name} in {path.parent} ({error}); this run goes on without it, and the "
            f"next computes it again: free disk space there (or set LAB_CACHE to a disk with room)")
        return False
