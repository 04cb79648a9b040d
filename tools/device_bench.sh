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
#   bash tools/device_bench.sh "--target cuda --arch sm_80 --dtype fp16 --torch-device cuda" \
#       "--target vulkan-spirv --arch ampere --dtype fp16 --torch-device cuda" ...
# It compiles every artifact at once, then benches each and profiles one UNet call of it
# (tools/dispatch_profile.py: bench-N.json/.log and profile-N.jsonl in $OUT). Setup, the model and the
# artifacts are kept in /tmp while the machine stays warm. MODEL, ART, OUT and HW (the image
# side, 512) can be set from outside, e.g. to try the script here on the tiny model.
source "$(dirname "$0")/device_env.sh"

names=()
for opts in "$@"; do
    names+=("$(echo "$opts" | tr -c 'a-zA-Z0-9_\n' '-' | tr -s '-' | sed 's/^-//; s/-$//')")
done

# Compile every artifact at once first (each with its own cache, so no two share a parameter
# archive being written): exports are mostly one torch thread, iree-compile uses the 16 cores.
t0=$(date +%s)
i=0
for opts in "$@"; do
    i=$((i + 1))
    read -r -a args <<< "$opts"
    only=()
    for ((k = 0; k < ${#args[@]}; k++)); do
        case "${args[k]}" in --target | --arch | --dtype) only+=("${args[k]}" "${args[k + 1]}") ;; esac
    done
    SDIREE_CACHE=/tmp/sdiree-cache/$i python3 -m sdiree.runtime.cli compile "$MODEL" \
        --height "${HW:-512}" --width "${HW:-512}" "${only[@]}" --out "$ART/${names[i - 1]}" \
        > "/tmp/compile-$i.log" 2>&1 &
done
wait || true
echo "=== compiled all in $(($(date +%s) - t0)) s"
for ((k = 1; k <= i; k++)); do tail -n 3 "/tmp/compile-$k.log"; done

i=0
for opts in "$@"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # one string of options per run
    read -r -a args <<< "$opts"
    name=${names[i - 1]}
    echo "=== bench $i: $opts"
    SDIREE_CACHE=/tmp/sdiree-cache/$i python3 tools/bench.py "$MODEL" --height "${HW:-512}" --width "${HW:-512}" \
        "${args[@]}" --out "$ART/$name" --json "$OUT/bench-$i.json" 2>&1 | tee "$OUT/bench-$i.log" ||
        echo "=== bench $i failed"
    # Where the UNet call's time goes, per dispatch (tools/dispatch_profile.py); the bundle stays here.
    driver=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['target']['driver'])" \
        "$ART/$name/manifest.json" 2>/dev/null || echo cuda)
    echo "=== profile $i ($driver)"
    timeout 120 python3 tools/dispatch_profile.py "$ART/$name" --device "$driver" --top 30 \
        --out "/tmp/prof-$i" 2>&1 || echo "=== profile $i failed"
    cp "/tmp/prof-$i/unet.dispatch.jsonl" "$OUT/profile-$i.jsonl" 2>/dev/null || true
done
