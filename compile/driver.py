"""`sdiree compile`: model folder → per-submodule MLIR, parameter archives, vmfbs, manifest.

Stages: load (model folder and its family, configs, content hash), export (one MLIR per
submodule, shared by every target with the same export choices: compile/export_stage.py),
parameters (one archive per scope and dtype, shared by every target/arch/shape:
compile/params_stage.py), compile (one vmfb per submodule; where the
target encodes its parameters, with its encoder and the encoder's output:
compile/encoded_stage.py), then the archives the runtime loads are linked into the artifact, the
runtime's tokenizer and scheduler files copied, and the manifest written last. Every stage is
keyed by its inputs: unchanged inputs are reused and said to be, a changed flag or spec
recompiles only what it touches. What is decided before any file is written (options, checks,
arch/dtype/size, where files go) is compile/plan.py's.

Where files go. The artifact directory (`--out`) is self-contained: it holds every file the
runtime reads, the shared parameter archives included as hardlinks (no extra disk; a copy where
the cache is on another filesystem), so it can be copied or moved on its own. What is shared
between artifacts, the exported MLIR and the parameter archives, lives in one cache per model:

    <cache>/mlir/<submodule>-<export key>.mlirbc (+ .json: its signature)
    <cache>/params/<model hash>-<dtype>/<scope>[.<derived>].irpa (+ .irpa.sha256)
    <cache>/.model-hashes.json

<cache> is `artifacts/<model>/` for the default --out (`artifacts/<model>/<target>-...`), and
for an explicit --out `$SDIREE_CACHE/<model>/`, `$SDIREE_CACHE` defaulting to
`${XDG_CACHE_HOME:-~/.cache}/sdiree`. What models of one architecture share
(compile/build_cache.py) lives in that user cache for every compile, whatever its --out, so a
compile with --out and one without share it: exports, by the architecture, in
`$SDIREE_CACHE/.exports/`, and compiled modules, by their MLIR, flags and specs, in
`$SDIREE_CACHE/.modules/`; so a second SD 1.5 fine-tune writes and encodes its weights but
neither exports nor runs iree-compile. Nothing else is written outside --out and these caches.
Deleting the caches costs only the time to build again.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

from sdiree.runtime import __version__ as SDIREE_VERSION
from sdiree.runtime.errors import UserError
from sdiree.runtime.fileutil import (
    atomic_copy,
    atomic_write_json,
    cached_sha256,
    file_stamp,
    link_or_copy,
    read_json_dict,
    remove_stale_temps,
    sha256_file,
    sha256_json,
    user_cache_dir,
)
from sdiree.runtime.host_memory import map_large_blocks, release_freed_heap
from sdiree.runtime.manifest import HASH_CACHE, MANIFEST_NAME, check_files, load_manifest
from sdiree.runtime.weights.sources import file_sha256

from .build_cache import CACHED, BuildCache
from .encoded_stage import add_layout, compile_encoded, encoder_intact, layout_tried
from .export_stage import ExportStage
from .exporters import ensure_kernels
from .manifest_writer import build_manifest
from .params_stage import DISK_FULL, ParamsStage
from .plan import (  # noqa: F401  (re-exported: callers import the compile API from here)
    CACHE_ENV,
    MAX_SIDE,
    SUBMODULES,
    CompileOptions,
    Plan,
    embedded_spec,
    flags_for,
    resolve,
)
from .quiet import quiet_libraries
from .report import Reporter

TOKENIZER_FILES = ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json")
BUILD_STATE = ".build-state.json"


def _versions() -> dict:
    from importlib.metadata import version

    names = ("torch", "diffusers", "transformers", "iree-turbine", "iree-base-compiler")
    return {"sdiree": SDIREE_VERSION, **{n: version(n) for n in names}}


class Builder(ExportStage, ParamsStage):
    """One compile's stages over its plan: export (export_stage.py), parameters
    (params_stage.py), compile and encode (here and compile/encoded_stage.py), and the
    artifact's archives linked and pruned."""

    def __init__(self, plan: Plan, reporter: Reporter):
        self.plan = plan
        self.r = reporter
        self.versions = _versions()
        self.model_hash = ""
        self.vae_sha256 = ""  # of --vae's file
        self._torch_models: dict = {}
        self._sources: dict = {}  # component -> WeightSource
        self._plans: dict = {}
        # sha256 of the artifact's files by name, trusted while their stamp holds (HASH_CACHE)
        self.verified = read_json_dict(plan.out / HASH_CACHE)

    def written_dirs(self) -> list[Path]:
        """Every directory compile writes into, where a killed compile may have left temps."""
        out, shared = self.plan.out, self.plan.shared
        return [out, out / "tokenizer", out / "scheduler", shared, shared / "mlir"] + [
            self.params_dir(),
            self.modules.dir,
            self.exports.dir,
        ]

    def link_archives(self, params: list[tuple[Path, str]], state: dict) -> list[tuple[Path, str]]:
        """Put the shared archives the runtime loads into the artifact (hardlinks, or copies
        across filesystems); [(path in the artifact, sha256)]. A pruned copy of the same
        archive that a build left there (compile/prune.py) stays: pruning it again reads the
        full one from the cache."""
        from .prune import is_pruned

        linked = []
        for path, digest in params:
            local = self.plan.out / path.name
            if is_pruned(local, digest, state, self.intact):
                linked.append((local, digest))
                continue
            kept_copy = (  # from an earlier build, where links cannot be made: not copied again
                local.is_file()
                and local.stat().st_dev != path.stat().st_dev
                and self.intact(local, digest)
            )
            if not kept_copy:
                link_or_copy(path, local)
            # a new link changes the archive's ctime: its recorded stamp, just verified, follows
            self.record_digest(path, digest)
            linked.append((local, digest))
        return linked

    def prune_archives(self, results: dict, state: dict) -> dict[str, Path]:
        """Prune the artifact's original archives to what the encoded ones lack (prune.py);
        results' archive digests follow. Returns the sidecars {name: path} for the manifest."""
        from .exporters import scope_for
        from .prune import ArchiveUse, prune

        out = self.plan.out
        uses: dict[Path, ArchiveUse] = {}
        for sub, res in results.items():
            enc = res.get("encoded")
            res["vmfb"] = f"{sub}.vmfb"
            res["loads"] = [(p, scope_for(sub)) for p, _ in res["params"]]
            if enc:
                res["loads"].append((out / enc["path"], enc["scope"]))
            for (local, digest), (source, _) in zip(res["params"], res["sources"], strict=True):
                use = uses.setdefault(local, ArchiveUse(local, source, digest, scope_for(sub)))
                use.users.append(sub)
        scopes = {sub: scope_for(sub) for sub in results}
        changed = prune(
            out, list(uses.values()), results, scopes, self.plan.target.driver, state, self.r,
            self.intact,
        )  # fmt: skip
        atomic_write_json(out / BUILD_STATE, state)
        for res in results.values():
            res["params"] = [(p, changed.get(p, sha)) for p, sha in res["params"]]
        return {p.name: p for p in changed if p.suffix == ".json"}

    def _compile_inputs(self, submodule: str, mlir: Path) -> dict:
        """What iree-compile's output (the module and its parameter encoder) depends on."""
        flags, specs = flags_for(self.plan, submodule)
        # a spec's flag names its file under the specs directory: its sha256 (specs) is the
        # input, not where a --specs copy or the installed package put it
        where = str(self.plan.registry.specs_dir)
        key = {
            "mlir": sha256_file(mlir),
            "flags": [f.replace(where, "<specs>") for f in flags],
            "specs": specs,
            "compiler": self.versions["iree-base-compiler"],
        }
        if self.plan.target.encode_parameters and self.plan.target.encoder_driver:
            key["encoder"] = [self.plan.target.encoder_driver, *self.plan.target.encoder_flags]
        if self.f16_ops:
            key["f16_matrix_operands"] = 1  # compile/spirv_f16_operands.py's rewrite
        return key

    @property
    def f16_ops(self) -> bool:
        """The arch's `f16_matrix_operands` (compile/spirv_f16_operands.py)."""
        return self.plan.target.arch(self.plan.arch).f16_matrix_operands

    def said_rewritten(self, submodule: str, count: int) -> None:
        if count:
            self.r.say(f"{submodule}: {count} cooperative-matrix shaders take their f16 matrices")

    def compile_key(self, submodule: str, mlir: Path, params_shas: list[str]) -> str:
        return self.compile_keys(submodule, mlir, params_shas)[0]

    def compile_keys(self, submodule: str, mlir: Path, params_shas: list[str]) -> tuple[str, str]:
        """(the artifact's compile key, recorded in its build state; the key of the compiled
        module in the module cache (compile/build_cache.py), the same for every model whose
        export gives the same MLIR), from one hash of the MLIR."""
        key = self._compile_inputs(submodule, mlir)
        encoded = self.plan.target.encode_parameters
        module_key = sha256_json({"module_cache": 1, "encoded": encoded, **key})
        if encoded:
            key["encoded_from"] = params_shas  # the encoded archive is computed from these
        return sha256_json(key), module_key

    @property
    def modules(self) -> BuildCache:
        """Compiled modules shared by every model and artifact (compile/build_cache.py), in
        the user cache whatever --out is."""
        return BuildCache(self.plan.build_root, "modules")

    @property
    def exports(self) -> BuildCache:
        """Exports shared by every model of an architecture (compile/build_cache.py), in the
        user cache whatever --out is."""
        return BuildCache(self.plan.build_root, "exports")

    def ensure_vmfb(
        self, submodule: str, mlir: Path, params: list[tuple[Path, str]], state: dict
    ) -> dict:
        from .iree_compile import compile_mlir
        from .tuning_embed import with_spec

        flags, specs = flags_for(self.plan, submodule)
        ensure_kernels(self.export_options(submodule))
        key, mkey = self.compile_keys(submodule, mlir, [sha for _, sha in params])
        out = self.plan.out
        vmfb = out / f"{submodule}.vmfb"
        encoded = out / f"{submodule}.encoded.irpa"
        prev = state.get(submodule, {})
        archives = [path for path, _ in params]
        if (
            prev.get("compile_key") == key
            and self.intact(vmfb, prev.get("vmfb_sha256"))
            and (not prev.get("encoded") or self.intact(encoded, prev["encoded"]["sha256"]))
            and encoder_intact(self, prev.get("encoded"))
        ):
            self.r.reused("compile", submodule)
            # built before every layout was learned, or stopped while learning it
            self.ensure_layout(submodule, prev, archives, state)
            return prev
        log = out / f"{submodule}.compile.log"
        entry = {"compile_key": key, "flags": flags, "tuning_specs": specs}
        spec = embedded_spec(self.plan, submodule)
        if not self.plan.target.encode_parameters:
            if self.modules.fetch(mkey, {"vmfb": vmfb}) is not None:
                self.r.reused("compile", submodule, CACHED)
            else:
                with self.r.stage("compile", submodule), with_spec(mlir, spec, out) as src:
                    self.said_rewritten(
                        submodule, compile_mlir(src, vmfb, flags, log, self.f16_ops)
                    )
                self.modules.store(mkey, {"vmfb": vmfb})
        else:
            entry["encoded"] = compile_encoded(
                self, submodule, mlir, mkey, spec, archives, flags, log
            )
        entry["vmfb_sha256"] = sha256_file(vmfb)
        state[submodule] = entry
        atomic_write_json(self.plan.out / BUILD_STATE, state)  # a stop in the layout resumes there
        self.ensure_layout(submodule, entry, archives, state)
        return entry

    def ensure_layout(self, submodule: str, entry: dict, archives: list[Path], state: dict) -> None:
        """Learn the layout of entry's encoded archive unless it was learned (or tried), and
        record it in the build state."""
        enc = entry.get("encoded")
        if enc and not layout_tried(enc, self.plan.out):
            add_layout(self, submodule, enc, archives)
            atomic_write_json(self.plan.out / BUILD_STATE, state)

    def intact(self, path: Path, digest: str | None) -> bool:
        """path, a file in the artifact, exists and has sha256 digest."""
        return path.is_file() and cached_sha256(path, path.name, self.verified) == digest


def compile_model(opts: CompileOptions, reporter: Reporter | None = None) -> Path:
    """Build (or bring up to date) one artifact directory; returns its manifest path."""
    r = reporter or Reporter()
    # each stage's freed GBs back to the system, not kept for the next (runtime/host_memory.py)
    map_large_blocks()
    if r.between_stages is None:
        r.between_stages = _FreedMemoryBack()
    plan = resolve(opts, r)  # bad input says so before the heavy libraries are imported
    quiet_libraries()
    made = _missing_dirs(plan.out)
    try:
        with _disk_full_is_user_error(plan):
            return _build(plan, r)
    except BaseException:
        # a compile that failed before writing into the folders it made leaves none of them
        for d in made:
            with contextlib.suppress(OSError):
                d.rmdir()  # an empty folder only
        raise


class _FreedMemoryBack:
    """What a finished stage freed, back to the system (the Reporter runs it after each, with
    the stage's seconds): malloc_trim always (milliseconds), and before it a full gc pass when
    the stage took COLLECT_EVERY times the last pass or longer. With torch loaded a pass visits
    ~0.5 M objects (0.3-0.9 s): the tiny SD 1.x's vulkan-spirv compile spent 11 of its 51 s in
    them after sub-second stages, finding a few hundred objects each; a large model's stages
    are long, so each still gets its pass."""

    COLLECT_EVERY = 10.0

    def __init__(self) -> None:
        self.last_pass_s = 0.0

    def __call__(self, stage_s: float) -> None:
        if stage_s >= self.COLLECT_EVERY * self.last_pass_s:
            t0 = time.perf_counter()
            gc.collect()
            self.last_pass_s = time.perf_counter() - t0
        release_freed_heap()


def _missing_dirs(path: Path) -> list[Path]:
    """path and those of its parents that do not exist yet, innermost first."""
    missing = []
    while not path.exists() and path.parent != path:
        missing.append(path)
        path = path.parent
    return missing


def _build(plan: Plan, r: Reporter) -> Path:
    b = Builder(plan, r)
    plan.shared.mkdir(parents=True, exist_ok=True)
    with r.stage("hash", "model"):
        b.model_hash = plan.model.content_hash(plan.shared / ".model-hashes.json")
        if plan.vae_file is not None:  # another VAE: other archives, exports and artifacts
            b.vae_sha256 = file_sha256(plan.vae_file)
            b.model_hash = sha256_json({"model": b.model_hash, "vae": b.vae_sha256})

    plan.out.mkdir(parents=True, exist_ok=True)
    for d in b.written_dirs():
        # this process writes nothing yet: a temp with its pid is an older process's (pid reuse)
        remove_stale_temps(d, include_own=True)
    state_path = plan.out / BUILD_STATE
    state = read_json_dict(state_path)

    manifest_path = plan.out / MANIFEST_NAME
    if _up_to_date(b, state):
        r.say(f"up to date: nothing to recompile in {plan.out}")
        return manifest_path
    # From here files the old manifest names may change: drop it first, write it again last.
    manifest_path.unlink(missing_ok=True)

    results = {}
    for i, sub in enumerate(plan.submodules):
        mlir = b.ensure_mlir(sub)
        params = b.ensure_params(sub)
        b.release_torch(sub, later=plan.submodules[i + 1 :])
        compiled = b.ensure_vmfb(sub, mlir, params, state)
        enc = compiled.get("encoded")
        if enc and not enc["needs_derived"]:
            params = params[:1]  # the derived weights are all in the encoded archive
        results[sub] = {"mlir": mlir, **compiled, "params": b.link_archives(params, state)}
        results[sub]["sources"] = params

    runtime_files = _copy_runtime_files(plan, r)
    if plan.target.encode_parameters:
        runtime_files.update(b.prune_archives(results, state))
    signatures = {sub: b.export_signature(sub) for sub in plan.submodules}
    manifest = build_manifest(b, results, signatures, runtime_files)
    _remove_unlisted_archives(plan.out, manifest["files"])
    atomic_write_json(manifest_path, manifest)
    # every file was hashed or verified above: the runtime's first check need not read them
    atomic_write_json(
        plan.out / HASH_CACHE,
        {rel: [*file_stamp(plan.out / rel), sha] for rel, sha in manifest["files"].items()},
    )
    r.say(r.summary())
    r.say(f"wrote {manifest_path}")
    return manifest_path


@contextlib.contextmanager
def _disk_full_is_user_error(plan: Plan) -> Iterator[None]:
    """A full disk (or quota) while compiling: one line naming where, not a traceback. Every
    write is to a temp name, removed on the way out, so nothing half-written stays."""
    try:
        yield
    except (OSError, RuntimeError, UserError) as e:
        if isinstance(e, OSError) and e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        if not isinstance(e, OSError) and not DISK_FULL.search(str(e)):
            raise
        # a copy that fails names its source first and the file it was writing second
        written = getattr(e, "filename2", None) or getattr(e, "filename", None)
        # else a library's write (iree's, a C compiler's): the fuller of the two places
        where = Path(written).parent if written else min((plan.out, plan.shared), key=_free_space)
        free = _free_space(where)
        caches = (plan.shared, user_cache_dir())  # the model's, and the kernels' (.kernels)
        in_cache = any(c in (where, *where.parents) for c in caches) and plan.out not in (
            where,
            *where.parents,
        )
        fix = f"set {CACHE_ENV} elsewhere" if in_cache and plan.explicit_out else ""
        fix = fix or "choose another --out"
        raise UserError(
            f"no space left on device writing to {where} ({_size(free)} free there); "
            f"free space or {fix}"
        ) from None


def _free_space(where: Path) -> int:
    """Bytes free on the filesystem of where (of its nearest existing folder)."""
    while not where.exists():
        where = where.parent
    return shutil.disk_usage(where).free


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**10:.0f} KiB"


def _remove_unlisted_archives(out: Path, files: dict) -> None:
    """Drop archives an earlier build of this artifact linked in and this one does not use."""
    for p in [*out.glob("*.irpa"), *out.glob("*.irpa.pruned.json")]:
        if p.name not in files:
            p.unlink(missing_ok=True)


def _up_to_date(b: Builder, state: dict) -> bool:
    """True when the manifest exists and every stage's key and file still match."""
    plan = b.plan
    try:
        manifest = load_manifest(plan.out)
    except UserError:
        return False
    if manifest.data.get("build", {}).get("model_hash") != b.model_hash:
        return False
    if set(manifest.submodules) != set(plan.submodules):
        return False
    for sub in plan.submodules:
        mlir = b.mlir_path(sub)
        if not mlir.is_file() or not b.signature_path(sub).is_file():
            return False
        if state.get(sub, {}).get("compile_key") != b.compile_key(sub, mlir, b.params_digests(sub)):
            return False
        encoded = state.get(sub, {}).get("encoded")
        if not encoder_intact(b, encoded):
            return False
        if encoded and not layout_tried(encoded, plan.out):
            return False  # learned (and the originals pruned) by a rebuild
    if plan.target.encode_parameters and "pruned" not in state:
        return False  # built before the original archives were pruned
    try:  # every file there and whole: by its stamp, or hashed again where that changed
        check_files(manifest, plan.out / HASH_CACHE)
    except UserError:
        return False
    for sub in plan.submodules:
        b.r.reused("compile", sub)
    return True


def _copy_runtime_files(plan: Plan, r: Reporter) -> dict[str, Path]:
    """Tokenizer files and the scheduler config, which the torch-free runtime reads."""
    files = {}
    for tok in dict.fromkeys(te["tokenizer"] for te in plan.family.text_encoders):
        tok_src = plan.model.path / tok
        tok_dst = plan.out / tok
        tok_dst.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (tok_src / name).is_file():
                atomic_copy(tok_src / name, tok_dst / name)
                files[f"{tok}/{name}"] = tok_dst / name
        for needed in ("vocab.json", "merges.txt"):
            if f"{tok}/{needed}" not in files:
                raise UserError(f"{tok_src} has no {needed}; sdiree needs a CLIP BPE tokenizer")
    sched_dst = plan.out / "scheduler"
    sched_dst.mkdir(exist_ok=True)
    atomic_copy(
        plan.model.path / "scheduler" / "scheduler_config.json", sched_dst / "scheduler_config.json"
    )
    files["scheduler/scheduler_config.json"] = sched_dst / "scheduler_config.json"
    r.say("[runtime files] tokenizer and scheduler config copied")
    return files
