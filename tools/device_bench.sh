#!/usr/bin/env bash
# Full-size GPU benchmark on a lent NVIDIA machine (this workplace's `device` tool; see
# tools/PERFORMANCE.md, "GPU"). That machine has python3 3.12 with torch (CUDA) and
# transformers but no IREE, no diffusers and no network, so the packages travel with the
# working tree, and the SD 1.5-size random model is made there.
#
# Prepare here, once (x86-64, cp312 wheels; `printf '/.iree/\n/.gl/\n' >> .git/info/exclude`):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d W iree-base-compiler==3.13.0 iree-base-runtime==3.13.0 \
#     iree-turbine==3.9.0 diffusers==0.42.1 decorator importlib_metadata
#   unzip the compiler wheel into C/ and the others into R/, then
#   tar cf - -C C . | xz -9e > .iree/compiler.tar.xz; tar cf - -C R . | xz -9e > .iree/rest.tar.xz
#   (xz: the compiler wheel is 84 MB as a zip, 52 MB as xz; a call carries at most 64 MiB)
# and the Vulkan loader debs into .gl/ as the device README says.
#
# On the device (carry [".iree", ".gl"]), each argument is one `sdiree bench` option string:
#   bash tools/device_bench.sh "--target cuda --arch sm_80 --dtype fp32" \
#       "--target vulkan-spirv --arch ampere --dtype fp32 --torch-device cuda" ...
# Setup and the model are kept in /tmp while the machine stays warm; reports go to $OUT.
source "$(dirname "$0")/device_env.sh"

i=0
for opts in "$@"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # one string of options per run
    read -r -a args <<< "$opts"
    name=$(echo "$opts" | tr -c 'a-zA-Z0-9_\n' '-' | tr -s '-' | sed 's/^-//; s/-$//')
    echo "=== bench $i: $opts"
    python3 tools/bench.py "$MODEL" --height 512 --width 512 "${args[@]}" \
        --out "$ART/$name" --json "$OUT/bench-$i.json" 2>&1 | tee "$OUT/bench-$i.log" ||
        echo "=== bench $i failed"
done
