"""Sweep workgroup tiles of the cuda UNet's least-occupied convolutions on a lent GPU, and write
the tuning spec its measurements pick.

Why: on an H200 the SD 1.5 UNet's 8² and 16² 1280-channel convs took ~9 of a guided call's
38 ms at ~14 TFLOP/s (tools/PERFORMANCE.md, twenty-seventh session). iree 3.13 gives every
channels-last f16 conv of cuda's preset one shape of tile, 128 output pixels by 32 channels for
8 warps of NV_MMA_SYNC 16x8x16 (each warp 32 by 16); at 8² half of its pixels are padding
(rows of 16 over an 8-wide image) and the guided call launches 80 workgroups (the unguided 40)
for an H100's 132 multiprocessors. Which tile does better is for the GPU to say, so this
measures it.

How: each conv of SHAPES (the UNet's at 512²: NHWC input, FHWC filter, the bias added, f16 in,
f32 accumulation, f16 out) is compiled by iree-compile for cuda, once as the compiler
configures it and once per candidate tile (`candidates()`: rows, channels, warp tiles and K step
of the IGEMM TileAndFuse config, as a one-matcher tuning spec), each dispatch repeated
`--repeat` times in its command buffer (`--iree-hal-benchmark-dispatch-repeat-count`), then
timed in one process on the GPU (median of `--runs` calls, inputs already on the device) with
its output checked against the compiler's own config (rel error <= PARITY). A candidate that
fails to compile or to match is dropped and counted. Then `spec()` writes the tuning spec: per
shape, the fastest candidate that beats the compiler's config by MIN_GAIN, matched by the
exact sizes measured (any other size keeps the compiler's choice).

    python tools/cuda_conv_sweep.py --arch sm_80 --out DIR [--shapes 0,2] [--tiles r4c32w2x2k8,...]
        [--dry]

`--dry` (any machine) compiles only, and checks from the configuration dump that each
candidate's tile is the one the module took. Outputs in DIR: sweep.json (every timing) and
cuda_small_convs.mlir (the spec, unless nothing won). tools/device_cuda_sweep.sh runs it on a
lent GPU; tests/tools/test_cuda_conv_sweep.py checks the candidates, the spec and the timer.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tuning_spec_text import APPLY_OP_CONFIG, CONVS, conv_head, entrypoint, yield_config  # noqa: E402

MARKER = "__tuning_spec_applied__"
MMA = "NV_MMA_SYNC_F32_16x8x16_F16"  # iree 3.13's f16 intrinsic on sm_80/sm_89 (M 16, N 8, K 16)
MIN_GAIN = 0.03  # a candidate must take at least 3 % less time than the compiler's config
PARITY = 1e-2  # max |candidate - default| / max |default|: the same sums in another order


@dataclass(frozen=True)
class Shape:
    """One conv: batch (2: guided, 1: unguided), output side, input and output channels, stride."""

    batch: int
    side: int
    cin: int
    cout: int
    stride: int = 1

    @property
    def name(self) -> str:
        return f"n{self.batch}_{self.side}x{self.side}_{self.cin}to{self.cout}_s{self.stride}"


# SD 1.5's UNet at 512²: the 3x3 convs of its 8² and 16² levels in the guided call (resnets;
# the up blocks' first convs read the skip concatenation, 2560, 1920 or 640 channels; the
# downsamples from 16² and 32²), and the unguided call's resnet convs. The first are what the
# H200 profile showed; a full UNet's configuration dump shows each of these as a dispatch.
SHAPES = [
    Shape(2, 8, 1280, 1280),
    Shape(2, 8, 2560, 1280),
    Shape(2, 8, 1280, 1280, 2),
    Shape(2, 16, 1280, 1280),
    Shape(2, 16, 2560, 1280),
    Shape(1, 8, 1280, 1280),
    Shape(1, 16, 1280, 1280),
    Shape(2, 16, 1920, 1280),
    Shape(2, 16, 640, 1280),
    Shape(2, 16, 640, 640, 2),
]


@dataclass(frozen=True)
class Tile:
    """An IGEMM TileAndFuse config: `rows` output rows of 16 pixels (padded past the image's
    width) by `channels` output channels per workgroup, each warp `warp_rows` rows by
    `warp_n` intrinsics of 8 channels, a K step of `k_steps` x 16."""

    rows: int
    channels: int
    warp_rows: int
    warp_n: int
    k_steps: int

    @property
    def warps(self) -> int:
        return (self.rows // self.warp_rows) * (self.channels // (8 * self.warp_n))

    @property
    def name(self) -> str:
        return f"r{self.rows}c{self.channels}w{self.warp_rows}x{self.warp_n}k{self.k_steps}"


def candidates() -> list[Tile]:
    """Tiles of 1 to 8 warps whose warp tiles divide the workgroup's."""
    out = []
    for rows, channels, warp_rows, warp_n, k_steps in itertools.product(
        (1, 2, 4, 8), (16, 32, 64, 128), (1, 2, 4), (1, 2, 4), (4, 8)
    ):
        if rows % warp_rows or channels % (8 * warp_n):
            continue
        tile = Tile(rows, channels, warp_rows, warp_n, k_steps)
        if 1 <= tile.warps <= 8:
            out.append(tile)
    return out


def config(tile: Tile, shape: Shape) -> str:
    """The compilation info of `tile` for `shape`'s conv, in the form iree 3.13 writes its own
    (padding only where the image is narrower than the tile's 16 columns, as iree does)."""
    lead = [1] if shape.batch > 1 else []
    wg = [*lead, tile.rows, 16, tile.channels]
    zeros = [0] * len(wg)
    pad = ""
    if shape.side % 16:
        pad = f"padding = {[*wg, 16 * tile.k_steps]}, padding_conv = {[*wg, 0, 0, 0]}, "
    return (
        "#iree_codegen.compilation_info<\n"
        "    lowering_config = #iree_gpu.lowering_config<{convert_acc_gemm, "
        f"mma_kind = #iree_gpu.mma_layout<{MMA}>,\n"
        f"      {pad}promote_operands = [0, 1], reduction = {[*zeros, tile.k_steps]},"
        f" subgroup = {[*lead, tile.warp_rows, 1, tile.warp_n, 0]}, workgroup = {[*wg, 0]}}}>,\n"
        "    translation_info = #iree_codegen.translation_info<"
        "pipeline = #iree_gpu.pipeline<TileAndFuse>\n"
        f"      workgroup_size = [{32 * tile.warps}, 1, 1] subgroup_size = 32,\n"
        "      {gpu_pipeline_options = #iree_gpu.pipeline_options<prefetch_num_stages = 2,"
        " no_reduce_shared_memory_bank_conflicts = false, use_igemm_convolution = true>}>>"
    )


def matcher(name: str, shape: Shape) -> list[str]:
    """A matcher of exactly `shape`'s conv (maps, element types and every size)."""
    maps, _ = CONVS[("batched" if shape.batch > 1 else "single", shape.stride)]
    batch = [shape.batch] if shape.batch > 1 else []
    return [
        *conv_head(name, maps),
        f"  transform.iree.match.dims_equal %batch, {batch} : !transform.param<i64>",
        f"  transform.iree.match.dims_equal %out_img, [{shape.side}, {shape.side}] : !transform.param<i64>",
        f"  transform.iree.match.dims_equal %out_ch, [{shape.cout}] : !transform.param<i64>",
        f"  transform.iree.match.dims_equal %in_ch, [{shape.cin}] : !transform.param<i64>",
        "  transform.iree.match.dims_equal %filt, [3, 3] : !transform.param<i64>",
    ]


def spec(choices: dict[Shape, Tile], stem: str = "cuda_small_convs") -> str:
    """A tuning spec giving each shape its chosen tile; every other op keeps iree's config."""
    out = [
        "// Generated by tools/cuda_conv_sweep.py from its measurements; see tools/PERFORMANCE.md.",
        "// cuda: the UNet's least-occupied channels-last f16 convs, each matched by its exact",
        "// sizes, take the tile measured fastest; every other op keeps the compiler's choice.",
        f"module @sdiree_{stem} attributes {{transform.with_named_sequence,",
        "    iree_codegen.tuning_spec_with_default_entrypoint} {",
        "",
        *APPLY_OP_CONFIG,
    ]
    pairs = []
    for shape, tile in choices.items():
        name = f"match_conv_{shape.name}"
        out += matcher(name, shape) + yield_config(config(tile, shape))
        pairs.append((name, "apply_op_config"))
    return "\n".join(out + entrypoint(pairs))


def conv_mlir(shape: Shape) -> str:
    """One function: `shape`'s conv over a zero-padded NHWC input, plus its bias, as the UNet's
    dispatch computes it (iree folds a batch of 1 away, as in the UNet's unguided call)."""
    s, k, n, o, i = shape.side, shape.stride, shape.batch, shape.cout, shape.cin
    side_in = (s - 1) * k + 3
    x, w = f"tensor<{n}x{side_in}x{side_in}x{i}xf16>", f"tensor<{o}x3x3x{i}xf16>"
    acc, y = f"tensor<{n}x{s}x{s}x{o}xf32>", f"tensor<{n}x{s}x{s}x{o}xf16>"
    return f"""func.func @conv(%x: {x}, %w: {w}, %b: tensor<{o}xf16>) -> {y} {{
  %z = arith.constant 0.0 : f32
  %e = tensor.empty() : {acc}
  %f = linalg.fill ins(%z : f32) outs(%e : {acc}) -> {acc}
  %c = linalg.conv_2d_nhwc_fhwc {{dilations = dense<1> : tensor<2xi64>, strides = dense<{k}> : tensor<2xi64>}}
    ins(%x, %w : {x}, {w}) outs(%f : {acc}) -> {acc}
  %e1 = tensor.empty() : {y}
  %r = linalg.generic {{indexing_maps = [affine_map<(a, b, c, d) -> (a, b, c, d)>,
      affine_map<(a, b, c, d) -> (d)>, affine_map<(a, b, c, d) -> (a, b, c, d)>],
      iterator_types = ["parallel", "parallel", "parallel", "parallel"]}}
    ins(%c, %b : {acc}, tensor<{o}xf16>) outs(%e1 : {y}) {{
  ^bb0(%i: f32, %bb: f16, %unused: f16):
    %be = arith.extf %bb : f16 to f32
    %s = arith.addf %i, %be : f32
    %t = arith.truncf %s : f32 to f16
    linalg.yield %t : f16
  }} -> {y}
  return %r : {y}
}}
"""


def compile_one(src: Path, out: Path, flags: list[str], spec_text: str | None) -> str | None:
    """Compile `src` to `out` (and its configuration dump beside it), `spec_text` attached to
    a copy of the source: iree 3.13's cuda pipeline ignores `--iree-codegen-tuning-spec-path`
    (compile/NOTES.md), as the registry's `tuning_spec_via` for cuda says. None, or why not."""
    from sdiree.compile.iree_compile import iree_compile_tool
    from sdiree.compile.tuning_embed import attach

    if spec_text is not None:
        spec_path = out.with_suffix(".spec.mlir")
        spec_path.write_text(spec_text)
        attach(src, spec_path, out.with_suffix(".mlirbc"))
        src = out.with_suffix(".mlirbc")
    args = [iree_compile_tool(), str(src), *flags, "-o", str(out)]
    args.append(f"--iree-hal-dump-executable-configurations-to={out.with_suffix('.cfg')}")
    r = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if r.returncode:
        lines = [x for x in r.stderr.splitlines() if "error" in x] or r.stderr.splitlines()
        return (lines[0] if lines else f"exit {r.returncode}")[:300]
    return None


def configured(out: Path) -> str:
    """The conv dispatch's configured source from `out`'s configuration dump."""
    texts = [p.read_text() for p in sorted(out.with_suffix(".cfg").glob("*.mlir"))]
    (text,) = [t for t in texts if "conv" in t]
    return text


def workgroup(text: str) -> list[int]:
    return json.loads(re.search(r"workgroup = (\[[^\]]*\])", text).group(1))


def inputs(shape: Shape, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    side_in = (shape.side - 1) * shape.stride + 3
    x = rng.standard_normal((shape.batch, side_in, side_in, shape.cin)).astype(np.float16)
    scale = (9 * shape.cin) ** -0.5
    w = (rng.standard_normal((shape.cout, 3, 3, shape.cin)) * scale).astype(np.float16)
    b = rng.standard_normal(shape.cout).astype(np.float16)
    return [x, w, b]


def time_module(vmfb: Path, device, args: list, runs: int, warmup: int = 2):
    """(median seconds of one call, output) of `vmfb`'s `conv` on `device`, whose inputs
    `args` already live there; copying the result to the host waits for the call."""
    import iree.runtime as rt

    from sdiree.runtime.device import to_host

    config = rt.Config(device=device)
    ctx = rt.SystemContext(config=config)
    ctx.add_vm_module(rt.VmModule.copy_buffer(ctx.instance, vmfb.read_bytes()))
    fn = ctx.modules.module["conv"]
    for _ in range(warmup):
        out = to_host(device, fn(*args))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        out = to_host(device, fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), np.asarray(out, dtype=np.float32)


def sweep(a: argparse.Namespace) -> dict:
    work = Path(tempfile.mkdtemp(prefix="sdiree-sweep-"))
    try:
        return _sweep(a, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _sweep(a: argparse.Namespace, work: Path) -> dict:
    shapes = [SHAPES[int(i)] for i in a.shapes.split(",")] if a.shapes else SHAPES
    tiles = candidates()
    if a.tiles:
        wanted = a.tiles.split(",")
        tiles = [t for t in tiles if t.name in wanted]
        if len(tiles) != len(wanted):
            sys.exit(f"unknown tiles: {sorted(set(wanted) - {t.name for t in tiles})}")
    flags = ["--iree-hal-target-device=cuda", f"--iree-cuda-target={a.arch}"]
    flags.append(f"--iree-hal-benchmark-dispatch-repeat-count={a.repeat}")
    jobs = []
    for shape in shapes:
        src = work / f"{shape.name}.mlir"
        src.write_text(conv_mlir(shape))
        jobs.append((shape, None, src, work / f"{shape.name}.default.vmfb", None))
        for tile in tiles:
            text = spec({shape: tile}, "candidate")
            jobs.append((shape, tile, src, work / f"{shape.name}.{tile.name}.vmfb", text))
    t0 = time.time()
    with ThreadPoolExecutor(a.jobs) as pool:
        errors = list(pool.map(lambda j: compile_one(j[2], j[3], flags, j[4]), jobs))
    print(f"compiled {len(jobs)} modules in {time.time() - t0:.0f} s", file=sys.stderr)

    rows = []
    for (shape, tile, _, vmfb, _), error in zip(jobs, errors, strict=True):
        row = {"shape": asdict(shape), "tile": asdict(tile) if tile else None, "error": error}
        if error is None:
            text = configured(vmfb)
            row["workgroup"] = workgroup(text)
            if tile is not None and MARKER not in text:
                row["error"] = "the spec did not match the conv"
        rows.append(row)
    if not a.dry:
        import iree.runtime as rt

        device = rt.get_driver(a.device).create_default_device()
        for shape in shapes:
            mine = [
                (j, r)
                for j, r in zip(jobs, rows, strict=True)
                if j[0] == shape and r["error"] is None
            ]
            if not mine or mine[0][0][1] is not None:
                print(f"{shape.name}: the compiler's own config did not build", file=sys.stderr)
                continue
            args = [rt.asdevicearray(device, x) for x in inputs(shape)]
            for (_, tile, _, vmfb, _), row in mine:
                if time.time() - t0 > a.budget:
                    row["error"] = "not timed: --budget spent"
                    continue
                try:
                    seconds, out = time_module(vmfb, device, args, a.runs)
                except RuntimeError as e:  # a candidate the GPU refuses: dropped, not fatal
                    row["error"] = f"run: {str(e).splitlines()[0][:300]}"
                    if tile is None:  # nothing to compare this shape's candidates with
                        break
                    continue
                row["seconds"] = seconds / a.repeat
                if tile is None:
                    ref, scale = out, float(np.abs(out).max())
                row["rel_error"] = float(np.abs(out - ref).max()) / scale
            timed = [r for _, r in mine if "seconds" in r]
            if timed and timed[0]["tile"] is None and len(timed) > 1:
                base = timed[0]["seconds"]
                best = min(timed[1:], key=lambda r: r["seconds"])
                print(
                    f"{shape.name}: default {base * 1e6:.0f} us, best {best['seconds'] * 1e6:.0f} us"
                    f" ({Tile(**best['tile']).name}, x{best['seconds'] / base:.3f})",
                    file=sys.stderr,
                )
            _write(a, rows)  # so far: a GPU fault later leaves these
    return _write(a, rows)


def _write(a: argparse.Namespace, rows: list[dict]) -> dict:
    result = {"arch": a.arch, "repeat": a.repeat, "runs": a.runs, "rows": rows}
    (a.out / "sweep.json").write_text(json.dumps(result, indent=1))
    return result


def choose(result: dict) -> dict[Shape, Tile]:
    """Per shape, the fastest candidate within PARITY of the compiler's output that takes at
    least MIN_GAIN less time than the compiler's config."""
    by_shape: dict[Shape, list[dict]] = {}
    for row in result["rows"]:
        if row["error"] is None and "seconds" in row:
            by_shape.setdefault(Shape(**row["shape"]), []).append(row)
    out = {}
    for shape, rows in by_shape.items():
        base = next((r["seconds"] for r in rows if r["tile"] is None), None)
        ok = [r for r in rows if r["tile"] and r["rel_error"] <= PARITY]
        if base is None or not ok:
            continue
        best = min(ok, key=lambda r: r["seconds"])
        if best["seconds"] <= base * (1 - MIN_GAIN):
            out[shape] = Tile(**best["tile"])
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="sm_80", help="iree's cuda target (the preset's arch)")
    p.add_argument("--out", type=Path, required=True, help="folder for sweep.json and the spec")
    p.add_argument("--shapes", help="indices into SHAPES, comma-separated (default: all)")
    p.add_argument("--tiles", help="candidate names to try, comma-separated (default: all)")
    p.add_argument("--device", default="cuda", help="IREE driver to time on")
    p.add_argument("--repeat", type=int, default=20, help="dispatch repeats per call")
    p.add_argument("--runs", type=int, default=7, help="timed calls per module")
    p.add_argument("--budget", type=float, default=420, help="seconds after which no more is timed")
    p.add_argument("--jobs", type=int, default=16, help="parallel iree-compile processes")
    p.add_argument("--dry", action="store_true", help="compile and check only; no GPU needed")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    result = sweep(a)
    bad = sum(r["error"] is not None for r in result["rows"])
    print(f"{len(result['rows']) - bad} modules, {bad} dropped", file=sys.stderr)
    if not a.dry:
        choices = choose(result)
        if choices:
            (a.out / "cuda_small_convs.mlir").write_text(spec(choices))
        print(f"spec: {len(choices)} of {len(SHAPES)} shapes tuned", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
