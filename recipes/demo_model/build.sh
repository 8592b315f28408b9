#!/usr/bin/env bash
# Rebuild resources/demo-qwen35.gguf from a clean checkout (issue 6). Run from the repository root.
# Stage 1: 280 steps from scratch; stage 2: 240 more steps from its checkpoint (new schedule and data
# order). Both deterministic for the thread count (default 1); timings in recipes/demo_model/README.md.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-recipes/demo_model/build}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -m recipes.demo_model.train --out "$OUT" --steps 280 --lr 3e-3 --seed 1234
$PY -m recipes.demo_model.train --out "$OUT/stage2" --init-from "$OUT/checkpoint.pt" --steps 240 --lr 2.5e-3 --seed 1235
$PY -m recipes.demo_model.export_gguf --build "$OUT/stage2" --out "${MODEL_OUT:-resources/demo-qwen35.gguf}"
