#!/usr/bin/env bash
# The cuda conv-tile sweep (tools/cuda_conv_sweep.py) on a lent NVIDIA machine, one device call
# (carry [".iree", ".gl"], setup as tools/device_bench.sh says; no model is made):
#   bash tools/device_cuda_sweep.sh [more sweep options]   # ARCH=sm_80 SHAPES=0,3 BUDGET=400
# $OUT gets sweep.json and, where a candidate won, cuda_small_convs.mlir. Then, here: put that
# file in specs/tuning/ and A/B the whole UNet against the preset in the next call:
#   TARGET=cuda PROFILE=none BENCH=tuned bash tools/device_variants.sh shipped \
#       'tuned:tuning_specs={"unet":"tuning/cuda_small_convs.mlir"}'
# (REUSE="tuned:shipped" shares the export; the spec changes only the compile.)
NO_MODEL=1 source "$(dirname "$0")/device_env.sh"
python3 tools/cuda_conv_sweep.py --arch "${ARCH:-sm_80}" --out "$OUT" ${SHAPES:+--shapes "$SHAPES"} \
    --budget "${BUDGET:-400}" "$@" 2>&1 | tee "$OUT/sweep.log"
