#!/usr/bin/env bash
# The Python packages a GPU machine without network lacks for the server, its tests and the profiles,
# downloaded here as wheels into ./.whl (ignored by git). The GPU scripts install them with
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl
# and put /tmp/site on PYTHONPATH (benchmark/offline/gpu_tp.sh does it when ./.whl exists).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=()
for p in manylinux_2_34_x86_64 manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 \
    manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_5_x86_64 manylinux1_x86_64; do
    platforms+=(--platform "$p")
done
# the server (fastapi imports opentelemetry), the ZMQ queues, the openai client the server tests use,
# structured output, and py-spy for native stacks; versions as the test environment resolves them
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 \
    typing-inspection==0.4.5 annotated-types==0.8.0 opentelemetry-api==1.45.2 pyzmq==27.3.0 \
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 sniffio==1.3.1 \
    distro==1.9.0 prompt_toolkit==3.0.53 wcwidth==0.9.4 gguf==0.19.0 xgrammar==0.2.9 \
    apache-tvm-ffi==0.1.15.post2 py-spy==0.4.3
ls .whl
