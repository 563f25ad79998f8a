#!/usr/bin/env bash
# Test-only reference tools (never runtime dependencies of engine). Pinned to torch 2.13.0 so nothing upgrades it;
# some tools declare a newer torch than they need and are installed with --no-deps (DESIGN.md, section 4).
set -euo pipefail
pin=$(mktemp); echo "torch==2.13.0" > "$pin"
pip install -q -c "$pin" transformers ml_dtypes gguf compressed-tensors constriction
