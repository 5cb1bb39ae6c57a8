"""DecoderConfig: the few numbers our decoder needs, read from an HF config (Llama, Qwen2, Qwen3, Mistral)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lab.errors import LabError


@dataclass(frozen=True, slots=True)
class DecoderConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False      # Qwen2: biases on q/k/v
    use_qk_norm: bool = False         # Qwen3: RMSNorm over each head of q and k
    rope_scaling: dict[str, Any] = field(default_factory=dict)
    model_type: str = "llama"

    @classmethod
    def from_hf(cls, hf_config: Any) -> "DecoderConfig":
        c = hf_config
        act = getattr(c, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise LabError(f"activation {act!r} is not supported", "use a SwiGLU (silu) Llama/Qwen-family model")
        # NOTE: transformers >= 5 keeps rope_theta and scaling in `rope_parameters`; older ones in rope_scaling.
        rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        rope_theta = float(rope.pop("rope_theta", getattr(c, "rope_theta", 10000.0)))
        rope.setdefault("rope_type", rope.pop("type", "default"))
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(
            vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers, num_heads=c.num_attention_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            head_dim=head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=rope_theta,
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(c, "attention_bias", c.model_type == "qwen2")),
            use_qk_norm=c.model_type == "qwen3", rope_scaling=rope, model_type=c.model_type,
        )

    def kv_bytes_per_token(self, itemsize: int, num_layers: int | None = None) -> int:
        """Keys + values of one token over all layers (or the first `num_layers`), `itemsize` bytes a value."""
        layers = self.num_layers if num_layers is None else num_layers
        return 2 * layers * self.num_kv_heads * self.head_dim * itemsize
