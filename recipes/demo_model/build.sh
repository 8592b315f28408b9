#!/usr/bin/env bash
# Rebuild resources/demo-qwen35.gguf from a clean checkout (issue 6). Run from the repository root.
# Stage 1: 280 steps from scratch; stages 2 and 3: 240 and 120 more steps, each from the previous
# checkpoint (new schedule and data order). Deterministic for the thread count (default 1); timings in
# recipes/demo_model/README.md.
set -euo pipefail
PY=${PYTHON:-.venv/bin/python}
OUT=${OUT:-recipes/demo_model/build}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
$PY -m recipes.demo_model.train --out "$OUT" --steps 280 --lr 3e-3 --seed 1234
$PY -m recipes.demo_model.train --out "$OUT/stage2" --init-from "$OUT/checkpoint.pt" --steps 240 --lr 2.5e-3 --seed 1235
$PY -m recipes.demo_model.train --out "$OUT/stage3" --init-from "$OUT/stage2/checkpoint.pt" --steps 120 --lr 1.5e-3 --seed 1236
$PY -m recipes.demo_model.export_gguf --build "$OUT/stage3" --out "${MODEL_OUT:-resources/demo-qwen35.gguf}"
