"""Training data for drafters: ShareGPT prompts answered by the target itself (greedy, our continuous-
batching engine), then the target's features on every token, computed once and cached.

Owns: the two caches under $LAB_CACHE/train/<target fingerprint>/ (responses JSON, features .pt) and what
is in them. Ignores: the drafters and their losses.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from lab.engines.continuous import ContinuousBatchingEngine
from lab.errors import LabError
from lab.kv_cache import PagedKVCacheConfig
from lab.kv_cache.base import NoCache
from lab.runner import ModelRunner
from lab.sched import SchedulerConfig
from lab.workloads.base import SamplingDefaults
from lab.workloads.datasets import DatasetWorkload


@dataclass(slots=True)
class DataConfig:
    dataset: str = "sharegpt"
    num_prompts: int = 256
    seed: int = 0
    max_prompt_len: int = 256
    max_new_tokens: int = 256
    max_num_seqs: int = 32
    feature_layers: tuple[int, ...] = ()   # filled in by the recipe: the union its drafter reads

    def __post_init__(self) -> None:
        for key in ("num_prompts", "max_prompt_len", "max_new_tokens", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise LabError(f"data.{key} must be >= 1, got {getattr(self, key)}", f"set data.{key} to a positive integer")

    def key(self) -> str:
        fields = {k: v for k, v in asdict(self).items() if k != "feature_layers"}
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:10]


@dataclass(slots=True)
class Sequence:
    token_ids: list[int]   # prompt + the target's greedy answer
    prompt_len: int


def generate_responses(runner: ModelRunner, config: DataConfig, cache_dir: Path, log=print) -> list[Sequence]:
    """The target answers `num_prompts` prompts (greedy, up to max_new_tokens, stopping at EOS); cached."""
    path = cache_dir / f"responses-{config.key()}.json"
    if path.is_file():
        return [Sequence(**s) for s in json.loads(path.read_text())]
    workload = DatasetWorkload(config.dataset, num_prompts=config.num_prompts, seed=config.seed,
                               output_len=config.max_new_tokens, max_tokens=config.max_new_tokens,
                               max_prompt_len=config.max_prompt_len, ignore_eos=False)
    requests = workload.build(runner.tokenizer, runner.vocab_size, SamplingDefaults())
    engine = ContinuousBatchingEngine(runner, SchedulerConfig(max_num_seqs=config.max_num_seqs),
                                      PagedKVCacheConfig(kv_cache_memory_mb=512), name="train-data")
    start = time.perf_counter()
    result = engine.run(requests)
    tokens = sum(r.num_output_tokens for r in result.requests)
    log(f"generated {tokens} answer tokens for {len(requests)} prompts in {time.perf_counter() - start:.0f} s")
    sequences = [Sequence(r.all_token_ids, r.num_prompt_tokens) for r in result.requests if r.num_output_tokens > 1]
    cache_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([asdict(s) for s in sequences]))
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


def load_training_data(runner: ModelRunner, config: DataConfig, cache_dir: Path, log=print
                       ) -> tuple[list[Sequence], list[torch.Tensor]]:
    """(sequences, their target features at config.feature_layers), from the caches when present."""
    sequences = generate_responses(runner, config, cache_dir, log)
    wanted = [i % runner.config.num_layers for i in config.feature_layers]
    # NOTE: one cache serves every drafter whose layers it covers (EAGLE's last layer is among DFlash's).
    for path in sorted(cache_dir.glob(f"features-{config.key()}-L*.pt")):
        stored = [int(i) for i in path.stem.split("-L", 1)[1].split("-")]
        if set(wanted) <= set(stored):
            features = torch.load(path, weights_only=True)
            hidden = runner.config.hidden_size
            columns = torch.cat([torch.arange(stored.index(i) * hidden, (stored.index(i) + 1) * hidden) for i in wanted])
            return sequences, [f if stored == wanted else f[:, columns] for f in features]
    start = time.perf_counter()
    features = target_features(runner, sequences, tuple(wanted))
    log(f"target features for {sum(len(s.token_ids) for s in sequences)} tokens in {time.perf_counter() - start:.0f} s")
    torch.save(features, cache_dir / f"features-{config.key()}-L{'-'.join(str(i) for i in wanted)}.pt")
    return sequences, features
