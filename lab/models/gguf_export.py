"""SmolLM2's weights as an F32 GGUF, for llama.cpp as a peer (scripts/llamacpp_peer.sh, experiments/bench_ar.py
--llama-cpp): the metadata and tokenizer of the bundled Q4_1 GGUF, every tensor dequantized to fp32, which are
exactly the values our cached model holds (checked on the embedding when written).

Owns: writing and caching that file. Ignores: who runs it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lab.errors import LabError
from lab.models.sources import convert_smollm2, default_cache_dir, find_smollm2_gguf

F32_GGUF_NAME = "smollm2-135m-instruct-f32.gguf"


def smollm2_f32_gguf(cache_dir: Path | None = None) -> Path:
    """The F32 GGUF under the lab cache, written once (~540 MB, a few seconds)."""
    path = (cache_dir or default_cache_dir()) / F32_GGUF_NAME
    if not path.exists():
        partial = path.with_suffix(".partial")
        write_f32_gguf(partial)
        partial.rename(path)
    return path


def write_f32_gguf(path: Path) -> None:
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize
    from safetensors.torch import load_file

    path.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(find_smollm2_gguf())
    writer = GGUFWriter(str(path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # the writer adds these itself
        vtype = GGUFValueType(field.types[0])
        value = 0 if name == "general.file_type" else field.contents()  # 0 = ALL_F32
        sub_type = GGUFValueType(field.types[1]) if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, vtype, sub_type)
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        writer.add_tensor(tensor.name, values.reshape([int(d) for d in reversed(tensor.shape)]))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = load_file(str(convert_smollm2(default_cache_dir()) / "model.safetensors"))["model.embed_tokens.weight"]
    embedding = next(t for t in reader.tensors if t.name == "token_embd.weight")
    diff = (torch.from_numpy(dequantize(embedding.data, embedding.tensor_type).copy()) - ours).abs().max().item()
    if diff >= 1e-6:
        path.unlink()
        raise LabError(f"the F32 GGUF does not hold our cached weights (embedding max |diff| {diff:g})",
                       f"delete {default_cache_dir()} so the model is converted again")
