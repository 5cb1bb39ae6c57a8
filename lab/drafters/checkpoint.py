"""Drafter checkpoints: weights (fp16 on disk, a few MB), the drafter's config, the fingerprint of the
target it was trained for, and the command that re-creates it. Loading a drafter for another target fails
with a clear error.

Owns: the file format and the target fingerprint. Ignores: training and drafting.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lab.errors import LabError
from lab.models.decoder import DecoderModel

FORMAT_VERSION = 1
REPO_ROOT = Path(__file__).resolve().parents[2]


def resolve_checkpoint(path: str) -> Path:
    """Absolute, or relative to the working directory, else to the repository (committed checkpoints)."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return REPO_ROOT / candidate


def target_fingerprint(model: DecoderModel) -> str:
    """Shape + a hash of the target's embedding and final norm, rounded to bf16 so fp32 and bf16 copies of
    the same weights agree: '<layers>x<hidden>-v<vocab>-<12 hex>'."""
    c = model.config
    digest = hashlib.sha256()
    for tensor in (model.embed_tokens.weight[:256], model.norm.weight, model.layers[-1].mlp.down_proj.weight[:8]):
        digest.update(tensor.detach().to("cpu", torch.bfloat16).float().contiguous().numpy().tobytes())
    return f"{c.num_layers}x{c.hidden_size}-v{c.vocab_size}-{digest.hexdigest()[:12]}"


def save_drafter(path: str | Path, drafter: nn.Module, target: DecoderModel, command: str,
                 metrics: dict[str, Any] | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", torch.float16) for k, v in drafter.state_dict().items()}
    torch.save({"format_version": FORMAT_VERSION, "kind": drafter.kind, "config": drafter.config.to_dict(),
                "target": target_fingerprint(target), "command": command, "metrics": metrics or {},
                "state_dict": state}, path)
    return path


def read_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise LabError(f"drafter checkpoint {path} does not exist",
                       "train one with `lab-train drafter=<eagle|dflash>` or set engine.proposer.checkpoint")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file gets the same message
        raise LabError(f"drafter checkpoint {path} is unreadable ({type(exc).__name__}: {exc})",
                       "re-create it with the command in docs/speculative.md") from exc
    if not isinstance(ckpt, dict) or ckpt.get("format_version") != FORMAT_VERSION:
        raise LabError(f"{path} is not a lab drafter checkpoint (format {FORMAT_VERSION})",
                       "re-create it with `lab-train`")
    return ckpt


def read_drafter_config(path: str | Path, kind: str) -> dict[str, Any]:
    """The drafter settings a checkpoint was trained with; refuses a drafter of another kind."""
    ckpt = read_checkpoint(path)
    _check_kind(ckpt, path, kind)
    return ckpt["config"]


def _check_kind(ckpt: dict[str, Any], path: str | Path, kind: str) -> None:
    if ckpt["kind"] != kind:
        raise LabError(f"{path} holds a {ckpt['kind']} drafter, not {kind}",
                       f"point engine.proposer.checkpoint at a {kind} checkpoint")


def load_drafter(path: str | Path, kind: str, target: DecoderModel, hf_config: object | None = None,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> nn.Module:
    """Build the drafter the checkpoint describes, for `target`; refuses a drafter of another kind or target."""
    from lab.drafters.dflash import DFlashConfig, DFlashDrafter
    from lab.drafters.eagle import EagleConfig, EagleDrafter

    ckpt = read_checkpoint(path)
    _check_kind(ckpt, path, kind)
    expected = target_fingerprint(target)
    if ckpt["target"] != expected:
        raise LabError(f"{path} was trained for target {ckpt['target']}, but this target is {expected}",
                       f"train a drafter for this model: `lab-train drafter={kind} model=<this model>`")
    builders = {"eagle": (EagleDrafter, EagleConfig), "dflash": (DFlashDrafter, DFlashConfig)}
    module_cls, config_cls = builders[kind]
    drafter = module_cls(target.config, config_cls(**ckpt["config"]), hf_config)
    drafter.load_state_dict({k: v.float() for k, v in ckpt["state_dict"].items()})
    return drafter.to(device=device, dtype=dtype).eval()

