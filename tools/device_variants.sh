#!/usr/bin/env bash
# Compile variants of one target on a lent NVIDIA machine and time them against each other
# (tools/module_ab.py, one process, calls alternated), then bench one of them against torch on
# the same GPU (tools/bench.py) and time each variant's UNet kernels with Nsight Compute
# (tools/dispatch_profile.py --ncu). Setup as tools/device_bench.sh says (carry [".iree", ".gl"]).
#
# Each argument is NAME or NAME:PATCH, PATCH a `;`-separated list of KEY=JSON edits of the
# target's entry in specs/targets.json (KEY dotted; `flags+=` appends to a list):
#   TARGET=cuda bash tools/device_variants.sh base 'pow2:export.attention="sdpa_pow2"' \
#       'nhwc:export.attention="sdpa_pow2";submodule_flags.unet+=["--iree-preprocessing-pass-pipeline=builtin.module(iree-preprocessing-transpose-convolution-pipeline)"]'
# BENCH names the variant benched against torch (default: the second, else the first; `none`: none);
# PROFILE the variants profiled (default: all; `none`: none). A variant whose patch keeps
# another's export (flags only) can share its cache: REUSE="NAME:FROM ...". Outputs in $OUT:
# ab.json, ab-vae.json, memory.jsonl (tools/load_memory.py of each variant's UNet and VAE decoder),
# bench.json/.log, ncu-NAME.txt, and compile-NAME.log of a variant that failed to
# compile ($OUT brings back at most 8 files). tools/PERFORMANCE.md ("fifteenth") has a run.
source "$(dirname "$0")/device_env.sh"
TARGET=${TARGET:-cuda}
HW=${HW:-512}

names=()
t0=$(date +%s)
for v in "$@"; do
    name=${v%%:*}
    patch=${v#"$name"}
    patch=${patch#:}
    names+=("$name")
    python3 - "$TARGET" "$name" "$patch" << 'EOF'
import json, shutil, sys
target, name, patch = sys.argv[1:]
dst = f"/tmp/specs-{name}"
shutil.rmtree(dst, ignore_errors=True)
shutil.copytree("specs", dst)
path = f"{dst}/targets.json"
data = json.load(open(path))
entry = data["targets"][target]
for edit in filter(None, patch.split(";")):
    key, value = edit.split("=", 1)
    append = key.endswith("+")
    *parents, last = key.rstrip("+").split(".")
    node = entry
    for k in parents:
        node = node.setdefault(k, {})
    value = json.loads(value)
    node[last] = node.get(last, []) + value if append else value
json.dump(data, open(path, "w"), indent=1)
print(f"variant {name}: {patch or '(as shipped)'}")
EOF
done

# Each variant has its own cache unless REUSE names another whose export it shares; those
# wait for that one to finish, then reuse its MLIR and parameters.
declare -A from=()
for r in ${REUSE:-}; do from[${r%%:*}]=${r#*:}; done
cache_of() { echo "/tmp/sdiree-cache/${from[$1]:-$1}"; }
compile() {
    local name=$1
    SDIREE_CACHE=$(cache_of "$name") python3 -m sdiree.runtime.cli compile "$MODEL" --target "$TARGET" \
        --height "$HW" --width "$HW" --specs "/tmp/specs-$name" --out "$ART/$name" \
        > "/tmp/compile-$name.log" 2>&1 && echo "=== compiled $name at $(($(date +%s) - t0)) s" ||
        { echo "=== compile $name FAILED: $(grep -m1 -i error "/tmp/compile-$name.log")"
          cp "/tmp/compile-$name.log" "$OUT/"; }
}
for name in "${names[@]}"; do
    if [ -z "${from[$name]:-}" ]; then
        compile "$name" &
    fi
done
for name in "${names[@]}"; do
    if [ -n "${from[$name]:-}" ]; then
        (while [ ! -f "$ART/${from[$name]}/manifest.json" ] && pgrep -f "specs-${from[$name]} " > /dev/null; do
            sleep 2
        done
        compile "$name") &
    fi
done
wait || true
echo "=== compiled all in $(($(date +%s) - t0)) s"

built=()
for name in "${names[@]}"; do [ -f "$ART/$name/manifest.json" ] && built+=("$ART/$name"); done
if [ ${#built[@]} -gt 1 ]; then
    echo "=== A/B of the UNet call: ${built[*]}"
    timeout 240 python3 tools/module_ab.py "${built[@]}" --runs "${RUNS:-10}" --json "$OUT/ab.json" ||
        echo "=== A/B failed"
    echo "=== A/B of the VAE decode"
    timeout 180 python3 tools/module_ab.py "${built[@]}" --submodule vae_decoder --function decode \
        --runs "${RUNS:-10}" --json "$OUT/ab-vae.json" || echo "=== VAE A/B failed"
fi
# What each variant's UNet and VAE decoder hold on the device (tools/load_memory.py: the HAL
# allocator's live bytes after the load, its peak after one call), one process each.
for b in "${built[@]}"; do
    for sf in "unet denoise_cfg" "vae_decoder decode"; do
        read -r sub fn <<< "$sf"
        timeout 60 python3 tools/load_memory.py "$b" "$sub" --call "$fn" 2>&1 | tail -n 1 >> "$OUT/memory.jsonl"
    done
done
python3 -c "
import json, sys
for line in open(sys.argv[1]):
    try:
        d = json.loads(line)
    except ValueError:
        print('=== memory probe failed:', line[:200].strip())
        continue
    load, call = d['hal_after_load_mib'], d.get('hal_after_call_mib', {})
    print(f\"=== memory {d['artifact']} {d['submodule']}: device live {load.get('device_live')} MiB, \"
          f\"peak after a call {call.get('device_peak')} MiB, call {d.get('call_s')} s\")
" "$OUT/memory.jsonl" || true

bench=${BENCH:-${names[1]:-${names[0]}}}
if [ "$bench" != none ]; then
    echo "=== bench $bench against torch"
    SDIREE_CACHE=$(cache_of "$bench") timeout 240 python3 tools/bench.py "$MODEL" --height "$HW" --width "$HW" \
        --target "$TARGET" --specs "/tmp/specs-$bench" --out "$ART/$bench" --torch-device cuda --steps 20 \
        --runs 3 --warmup 1 --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || echo "=== bench failed"
fi

for name in ${PROFILE:-${names[@]}}; do
    [ -f "$ART/$name/manifest.json" ] || continue
    echo "=== ncu profile of $name"
    timeout 150 python3 tools/dispatch_profile.py "$ART/$name" --device "$TARGET" --ncu --group \
        --top 40 --out "/tmp/prof-$name" > "$OUT/ncu-$name.txt" 2>&1 || echo "=== profile $name failed"
    head -n 45 "$OUT/ncu-$name.txt"
done
