"""The F32 GGUF written for llama.cpp (lab/models/gguf_export.py) holds our cached weights in fp32 and the
bundled model's metadata; with llama-cpp-python installed, llama.cpp greedy-decodes our tokens from it.

Slow (writes ~540 MB): `make test-all`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from lab.engines.ar import AREngine
from lab.models.gguf_export import write_f32_gguf
from lab.runner import ModelRunner
from tests.helpers import make_requests

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def f32_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "smollm2-f32.gguf"
    write_f32_gguf(path)
    return path


def test_every_tensor_is_fp32_with_the_bundled_metadata(f32_gguf: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFReader

    reader = GGUFReader(f32_gguf)
    assert reader.fields["general.architecture"].contents() == "llama"
    assert len(reader.tensors) == 272   # 30 layers x 9 + token_embd + output_norm
    assert {t.tensor_type for t in reader.tensors} == {GGMLQuantizationType.F32}


def test_llama_cpp_decodes_our_greedy_tokens(f32_gguf: Path, smollm2_runner: ModelRunner) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    prompt = smollm2_runner.tokenizer("The capital of France is").input_ids
    ours = AREngine(smollm2_runner).run(make_requests([prompt], 16, ignore_eos=True)).requests[0]
    llm = llama_cpp.Llama(str(f32_gguf), n_ctx=64, verbose=False)
    theirs = []
    for token in llm.generate(prompt, top_k=1, temp=0.0):
        theirs.append(int(token))
        if len(theirs) == 16:
            break
    assert theirs == ours.output_token_ids
