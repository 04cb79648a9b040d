"""Which dispatch first makes a NaN or an inf? A debugging tool for a module that returns them.

Recompiles one submodule of a compiled artifact from its own MLIR (named in the manifest, in the
model's compile cache: `<cache>/mlir/`, see compile/driver.py) with the manifest's flags plus `--iree-flow-trace-dispatch-tensors`, runs
one call of one function on verify's seeded inputs with a debug sink that sees every dispatch's
inputs and outputs, and prints each traced tensor set that holds NaN or inf (every one with
--verbose): its key, and per tensor its shape, non-finite count and max |x|. It ends with the
first dispatch whose inputs were all finite and whose outputs were not: the kernel to look at
(its source: `--iree-hal-dump-executable-sources-to`).

    python tools/trace_nonfinite.py ARTIFACT --submodule vae_decoder --function decode \\
        [--mlir PATH] [--keep DIR] [--seed 0] [--poison] [--untraced | --no-trace --flag F]
        [--weights runtime|mapped|preload|read|aligned] [--runtime-flag F]

--poison calls once on NaN inputs first (memory a call reads before writing, or overwrites
that it should not, then shows NaN); --untraced runs the artifact's own module and --no-trace
--flag F a rebuild with more flags, as controls. --weights says how the archives reach the
device: `runtime` (the default: as a session loads them, `aligned` on a CPU Vulkan device,
else `mapped`), `mapped` (a read-only map of the file; its entries are not page-aligned, so a
Vulkan device gets copies in memory its HAL allocates), `preload` (the file
read into host memory), `read` (through a file descriptor) or `aligned` (each entry copied to
page-aligned memory, which the cpu HAL and a Vulkan driver with VK_EXT_external_memory_host
import as it is: then any entry a call writes is named). --runtime-flag passes an iree runtime
flag (e.g. --vulkan_robust_buffer_access=true). The artifact is not changed: a rebuilt module
runs from a scratch copy (links to the artifact's files, the manifest's entry for the module
rewritten; a pruned archive whose dropped weights the rebuilt module reads itself is written
there whole, read back from the encoded archives). Tracing reads every intermediate back to the
host, so a call takes longer.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import mmap
import os
import tempfile
import time
from pathlib import Path

import numpy as np


def _mlir_path(artifact: Path, manifest, submodule: str, given: str | None) -> Path:
    """The submodule's exported MLIR: given, or in the model's cache, which is the artifact's
    parent for the default --out and `$SDIREE_CACHE/<model>/` for an explicit one."""
    if given:
        return Path(given)
    from sdiree.runtime.errors import UserError
    from sdiree.runtime.fileutil import user_cache_dir

    name = manifest.data["submodules"][submodule]["mlir"]
    model = manifest.data["model"]["name"]
    for cache in (artifact.resolve().parent, user_cache_dir() / model):
        if (cache / "mlir" / name).is_file():
            return cache / "mlir" / name
    raise UserError(f"{name} is in no compile cache (deleted?); pass --mlir or compile again")


def _compile_traced(
    manifest, submodule: str, mlir: Path, out: Path, extra: list[str], trace: bool = True
) -> None:
    from sdiree.compile.iree_compile import compile_mlir
    from sdiree.compile.param_encoder import encoder_flags

    flags = [
        *manifest.data["submodules"][submodule]["flags"],
        *extra,
        *(["--iree-flow-trace-dispatch-tensors"] if trace else []),
    ]
    encoder = manifest.submodules[submodule].encoder
    with tempfile.TemporaryDirectory() as tmp:
        if encoder is not None:  # the module must read the artifact's encoded archive
            flags += encoder_flags(Path(tmp) / "encoder.mlir", encoder.scope)
        compile_mlir(mlir, out, flags, out.with_suffix(".log"))


def _scratch_artifact(artifact: Path, submodule: str, vmfb: Path, where: Path) -> Path:
    """A copy of the artifact made of links, with submodule's module replaced by vmfb, and any
    pruned archive whose dropped weights vmfb names written whole (_restore_archive)."""
    from sdiree.compile.prune import named_in
    from sdiree.runtime.fileutil import sha256_file
    from sdiree.runtime.weights.recover import read_sidecar, sidecar_path

    data = json.loads((artifact / "manifest.json").read_text())
    rel = data["submodules"][submodule]["vmfb"]
    named = vmfb.read_bytes()
    restored = []
    sub = data["submodules"][submodule]
    for path in [sub["parameters"], *(e["path"] for e in sub.get("extra_parameters", []))]:
        pruned = read_sidecar(artifact / path)
        if pruned and any(named_in(k, named) for k in pruned[0]):
            _restore_archive(artifact / path, where / path)
            data["files"][path] = sha256_file(where / path)
            data["files"].pop(sidecar_path(Path(path)).as_posix(), None)
            restored.append(path)
    skip = {Path(p) for p in restored} | {sidecar_path(Path(p)) for p in restored}
    for src in artifact.rglob("*"):
        name = src.relative_to(artifact)
        if src.is_file() and src.name != "manifest.json" and not src.name.startswith("."):
            if name in skip:
                continue
            dst = where / name
            dst.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(vmfb.resolve() if name == Path(rel) else src, dst)
    data["files"][rel] = sha256_file(vmfb)
    (where / "manifest.json").write_text(json.dumps(data))
    if restored:
        print(f"weights the rebuilt module reads itself, restored from the encoded archives: "
              f"{', '.join(restored)}", flush=True)  # fmt: skip
    return where


def _restore_archive(path: Path, dst: Path) -> None:
    """The pruned archive at path written whole at dst: its kept entries copied as they are,
    its dropped ones read back from the artifact's encoded archives (runtime/weights/
    recover.py). A rebuild with other flags may read a weight itself that the artifact's
    module reached only through its encoder (on an AVX-512 CPU without AMX, the traced tiny
    fp32 VAE decoder reads its mid-block attention's to_q weight), which the compile dropped."""
    import torch

    from sdiree.compile.archive_writer import metadata
    from sdiree.runtime.weights import irpa_writer
    from sdiree.runtime.weights.archive import Archive

    full = Archive(path)
    plan = []
    for key, e in full.entries.items():
        if e.recovered:
            meta = metadata(getattr(torch, e.dtype.name), e.shape).encode()
        else:
            meta = bytes(full.raw(key).metadata or b"")
        plan.append(irpa_writer.Entry(key, e.length, meta, e.splat))
    dst.parent.mkdir(parents=True, exist_ok=True)
    with irpa_writer.created(dst, plan) as (fd, offsets):
        for key, at in offsets.items():
            irpa_writer.pwrite_all(fd, np.ascontiguousarray(full.array(key)).view(np.uint8), at)


class NonFiniteSink:
    """Collects, per traced key, each tensor's shape, non-finite count and max |x|."""

    def __init__(self, verbose: bool):
        self.verbose = verbose
        self.active = True  # off: tensors are not looked at (the poisoning call)
        self.rows: list[tuple[str, list[tuple[tuple, int, float]]]] = []

    def __call__(self, key: str, buffer_views) -> None:
        import iree.runtime as rt

        if not self.active:
            return
        stats = []
        for bv in buffer_views:
            dtype = rt.HalElementType.map_to_dtype(bv.element_type)
            a = np.asarray(bv.map().asarray(bv.shape, dtype))
            finite = np.isfinite(a) if a.dtype.kind == "f" else np.ones(a.shape, bool)
            bad = int(a.size - np.count_nonzero(finite))
            peak = float(np.abs(a[finite]).max(initial=0))
            stats.append((tuple(bv.shape), bad, peak))
        self.rows.append((key, stats))
        if self.verbose or any(b for _, b, _ in stats):
            cells = "  ".join(f"{list(s)} bad={b} max={p:.4g}" for s, b, p in stats)
            print(f"{key}: {cells}", flush=True)

    def first_culprit(self) -> str | None:
        """The first outputs that hold non-finite values after inputs that were all finite,
        unless the dispatches after it fill those values in (_filled_later)."""
        inputs_ok = True
        for i, (key, stats) in enumerate(self.rows):
            bad = any(b for _, b, _ in stats)
            if " inputs" in key:  # also "inputs with {0, 1} decoded to row major layout"
                inputs_ok = not bad
            elif (
                " outputs" in key
                and bad
                and inputs_ok
                and not all(self._filled_later(i, s, b) for s, b, _ in stats if b)
            ):
                return key
        return None

    def _filled_later(self, row: int, shape: tuple, bad: int) -> bool:
        """Whether an output's non-finite values (at row, of shape, bad of them) are the
        memory's earlier contents, written over by the dispatches that follow: a chain of
        slice copies, each taking the tensor in and giving it back with fewer non-finite
        values, down to none (iree's Winograd input tiles: a call after one on NaN inputs
        sees the NaN that call left where no tile is written yet)."""
        taken = False
        for key, stats in self.rows[row + 1 :]:
            if " inputs" in key:
                taken = any(s == shape and b == bad for s, b, _ in stats)
                continue
            left = [b for s, b, _ in stats if s == shape]
            if not taken or not left or min(left) >= bad:
                return False
            bad = min(left)
            if bad == 0:
                return True
        return False


class WeightsLoaded:
    """While entered, the runtime adds an ordinary archive to its parameter index `how` (see
    --weights). With `aligned`, changed() afterwards names the entries whose memory a call
    wrote (they are imported, so a write from the device lands there)."""

    def __init__(self, how: str):
        self.how = how
        self.fds: list[int] = []
        self.copies: dict[str, tuple[mmap.mmap, Path, int, int]] = {}
        self.keep: list = []

    def __enter__(self):
        from sdiree.runtime.weights import overrides

        self._original = overrides.load_archive, overrides.add_importable
        if self.how != "runtime":  # both of the runtime's ways replaced by this one
            overrides.load_archive = self._load
            overrides.add_importable = lambda index, path, keep: self._load(index, path)
        return self

    def __exit__(self, *exc) -> None:
        from sdiree.runtime.weights import overrides

        overrides.load_archive, overrides.add_importable = self._original

    def _load(self, index, path: Path) -> None:
        import iree.runtime as rt

        from sdiree.runtime.weights.imported import add_importable
        from sdiree.runtime.weights.pages import paged_layout

        if self.how == "mapped":
            return self._original[0](index, path)
        if self.how == "aligned":  # add_importable serves a paged archive as load_archive does
            for key, (copy, offset, length) in add_importable(index, path, self.keep).items():
                self.copies[key] = (copy, path, offset, length)
            return
        probe = rt.ParameterIndex()
        probe.load(str(path))
        if paged_layout(probe) is not None:
            return self._original[0](index, path)
        if self.how == "preload":
            return index.load(str(path), mmap=False)
        self.fds.append(os.open(path, os.O_RDONLY))  # read
        index.load_from_file_handle(rt.FileHandle.wrap_fd(self.fds[-1]), "irpa")

    def changed(self) -> list[str]:
        out, files = [], {}
        try:
            for key, (copy, path, offset, length) in self.copies.items():
                f = files.get(path) or files.setdefault(path, open(path, "rb"))  # noqa: SIM115
                f.seek(offset)
                if f.read(length) != copy[:length]:
                    out.append(key)
        finally:
            for f in files.values():
                f.close()
        return out

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)  # iree does not close a wrapped fd


def main(argv: list[str] | None = None) -> dict:
    """Returns {culprit: the key or None, traced: tensor sets seen, nonfinite: per result,
    digest: of the results, written: the parameter entries written (--weights aligned)}."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--submodule", required=True)
    ap.add_argument("--function", required=True)
    ap.add_argument("--mlir", help="the submodule's exported MLIR (default: from the cache)")
    ap.add_argument("--keep", type=Path, help="keep the traced module here (reused if present)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--input-scale", type=float, default=1.0, help="multiply the float inputs by this"
    )
    ap.add_argument("--verbose", action="store_true", help="print every traced key")
    ap.add_argument(
        "--poison",
        action="store_true",
        help="call once on NaN inputs first: a kernel reading memory it never wrote then "
        "sees NaN left by that call (a fresh process's memory is zeros)",
    )
    ap.add_argument(
        "--flag", action="append", default=[], help="one more iree-compile flag (repeatable)"
    )
    ap.add_argument(
        "--no-trace",
        action="store_true",
        help="recompile without tracing (with --flag: does a flag change the result?)",
    )
    ap.add_argument(
        "--untraced", action="store_true", help="run the artifact's own module (a control)"
    )
    ap.add_argument(
        "--runtime-flag",
        action="append",
        default=[],
        help="an iree runtime flag, e.g. --vulkan_dispatch_abi=descriptor (repeatable)",
    )
    ap.add_argument(
        "--weights",
        choices=("runtime", "mapped", "preload", "read", "aligned"),
        default="runtime",
        help="how the archives reach the device (default: as the runtime loads them)",
    )
    args = ap.parse_args(argv)

    import iree.runtime as rt

    from sdiree.compile.verify import make_inputs
    from sdiree.runtime.device import find_device
    from sdiree.runtime.manifest import load_manifest
    from sdiree.runtime.session import Session

    if args.runtime_flag:
        rt.flags.parse_flags(*args.runtime_flag)
    manifest = load_manifest(args.artifact)
    with tempfile.TemporaryDirectory() as tmp, WeightsLoaded(args.weights) as weights:
        tag = "plain" if args.no_trace else "traced"
        if args.flag:
            tag += "-" + hashlib.sha256("\n".join(args.flag).encode()).hexdigest()[:8]
        vmfb = Path(args.keep or tmp) / f"{args.submodule}.{tag}.vmfb"
        if args.untraced:
            scratch = manifest
        elif not vmfb.is_file():
            vmfb.parent.mkdir(parents=True, exist_ok=True)
            t0 = time.monotonic()
            _compile_traced(
                manifest,
                args.submodule,
                _mlir_path(args.artifact, manifest, args.submodule, args.mlir),
                vmfb,
                args.flag,
                trace=not args.no_trace,
            )
            print(f"compiled the {tag} module in {time.monotonic() - t0:.0f}s", flush=True)
        if not args.untraced:
            scratch = _scratch_artifact(args.artifact, args.submodule, vmfb, Path(tmp) / "a")
            scratch = load_manifest(scratch)
        driver = scratch.data["target"]["driver"]
        sink = NonFiniteSink(args.verbose)
        session = Session(
            scratch,
            find_device(driver, driver),
            [args.submodule],
            debug_sink=rt.HalModuleDebugSink(sink),
        )
        inputs = make_inputs(scratch, args.submodule, args.function, args.seed)
        inputs = [x * x.dtype.type(args.input_scale) if x.dtype.kind == "f" else x for x in inputs]
        if args.poison:
            nan = [np.full_like(x, np.nan) if x.dtype.kind == "f" else x for x in inputs]
            sink.active = False
            session.call(args.submodule, args.function, *nan)
            sink.active = True
            print("poisoned: called once on NaN inputs", flush=True)
        t0 = time.monotonic()
        outs = session.call(args.submodule, args.function, *inputs)
        print(f"call took {time.monotonic() - t0:.0f}s; {len(sink.rows)} traced tensor sets")
        written = weights.changed() if args.weights == "aligned" else None
        if written is not None:
            print(
                f"parameter entries imported: {len(weights.copies)}, "
                f"written by the calls: {len(written)} {written[:5]}"
            )
        del session
    weights.close()
    nonfinite = [int(o.size - np.isfinite(o).sum()) for o in outs]
    for o, bad in zip(outs, nonfinite, strict=True):
        print(f"result {list(o.shape)}: non-finite {bad}")
    culprit = sink.first_culprit()
    print(f"first non-finite outputs from finite inputs: {culprit or 'none'}")
    digest = hashlib.sha256(b"".join(o.tobytes() for o in outs)).hexdigest()
    return {
        "culprit": culprit,
        "traced": len(sink.rows),
        "nonfinite": nonfinite,
        "digest": digest,  # of the results' bytes
        "written": written,  # entries the calls wrote (--weights aligned), else None
    }


if __name__ == "__main__":
    main()  # a diagnostic: exit status 0 whatever it finds
