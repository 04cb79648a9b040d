#!/usr/bin/env bash
# Environment for sdiree on a lent NVIDIA machine, sourced by tools/device_bench.sh (and by hand:
# `source tools/device_env.sh` in a device `run`). Unpacks the carried packages (.iree/, see
# device_bench.sh) and the Vulkan loader (.gl/) once per machine, exposes this checkout as the
# `sdiree` package, prints the GPU and the devices sdiree sees, and makes the SD 1.5-size random
# model in $MODEL (unless NO_MODEL is set). Kept in /tmp while the machine stays warm.
set -euo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/sdiree-out}
SITE=/tmp/sdiree-site
PKG=/tmp/sdiree-pkg
MODEL=${MODEL:-/tmp/sd15-random}
ART=${ART:-/tmp/sdiree-art}
mkdir -p "$OUT" "$ART" "$PKG/sdiree"

if [ ! -d "$SITE/iree/compiler" ] && ! python3 -c "import iree.compiler" 2> /dev/null; then
    t0=$(date +%s)
    mkdir -p "$SITE"
    tar xJf .iree/compiler.tar.xz -C "$SITE"
    tar xJf .iree/rest.tar.xz -C "$SITE"
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
    echo "setup: $(($(date +%s) - t0)) s"
fi
# sdiree as a namespace package (its package-dir layout), straight from this checkout.
for d in compile runtime specs; do ln -sfn "$PWD/$d" "$PKG/sdiree/$d"; done
export PYTHONPATH="$PKG:$SITE"
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
if [ -f "$icd" ]; then export VK_DRIVER_FILES=$icd; fi

nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv || true
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
python3 -m sdiree.runtime.cli devices || true

if [ -z "${NO_MODEL:-}" ] && [ ! -f "$MODEL/model_index.json" ]; then
    t0=$(date +%s)
    python3 tools/make_sd15_random.py "$MODEL" > /dev/null
    echo "model: $(($(date +%s) - t0)) s"
fi

