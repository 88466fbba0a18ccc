#!/usr/bin/env bash
# Wheels of trtedge's run-time dependencies that the lent GPU machine's image lacks (it has torch, Triton,
# transformers, safetensors, tokenizers and numpy; Python 3.12, no package index), downloaded into .whl/
# (ignored by git) for a device call to carry and install:
#   pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
    manylinux1_x86_64 manylinux_2_5_x86_64)
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for p in "${platforms[@]}"; do args+=(--platform "$p"); done
for name in gguf typer click shellingham rich markdown-it-py mdurl starlette anyio sniffio uvicorn h11 httpx \
    httpcore certifi idna pydantic pydantic-core annotated-types typing-inspection prometheus-client \
    prompt-toolkit wcwidth pyzmq msgspec py-spy; do
    python3 -m pip download -q "${args[@]}" "$name"
done
du -sh .whl
