"""The parameters stage of the compile's Builder (compile/driver.py): one archive per scope and
dtype in the model's cache (and one of the weights an export derives), shared by every target,
arch and size; each written from the model's files one weight at a time, with its sha256 and
file stamp recorded beside it, so an intact archive is reused without hashing it again and a
damaged one is written again. A mixin: Builder holds the state it reads (plan, reporter,
model hash)."""

from __future__ import annotations

import contextlib
import errno
import json
import re
from pathlib import Path

from sdiree.runtime.fileutil import atomic_path, atomic_write_json, file_stamp, sha256_file

from .exporters import DERIVED_REVISION

# How a full disk reads where it does not come as an OSError (iree's archive writer, iree-compile)
DISK_FULL = re.compile(r"no space left on device|out of disk space|disk quota exceeded", re.I)


class ParamsStage:
    """Builder's parameter archives and their recorded digests (this file's docstring)."""

    def params_dir(self) -> Path:
        p = self.plan
        return p.shared / "params" / f"{self.model_hash[:16]}-{p.export_dtype}"

    def params_path(self, scope: str, derived: str | None = None) -> Path:
        """The shared archive of scope (the model's own weights), or with derived its archive of
        weights computed at export (e.g. `unet.winograd2.irpa`). The artifact holds a link to
        it under the same name."""
        name = f"{scope}.{derived}.irpa" if derived else f"{scope}.irpa"
        return self.params_dir() / name

    @staticmethod
    def is_derived(archive: Path) -> bool:
        """Whether archive, named by params_path, holds weights derived at export."""
        return archive.name.count(".") > 1

    def param_archives(self, submodule: str) -> list[Path]:
        """The archives submodule's MLIR reads (scope `scope_for(submodule)`): the shared one,
        then the one of weights derived at export, if its export made any."""
        from .exporters import scope_for

        derived = json.loads(self.signature_path(submodule).read_text()).get("derived")
        scope = scope_for(submodule)
        return [self.params_path(scope)] + ([self.params_path(scope, derived)] if derived else [])

    @staticmethod
    def digest_path(archive: Path) -> Path:
        return archive.with_suffix(".irpa.sha256")

    def recorded_digest(self, archive: Path) -> tuple[str, list | None]:
        """(sha256 recorded when archive was written, its file stamp then); ("", None) if none,
        or if archive holds derived weights computed by an older revision (written again).
        An older sdiree wrote the bare digest: it is re-verified once."""
        try:
            text = self.digest_path(archive).read_text()
        except OSError:
            return "", None
        with contextlib.suppress(ValueError):
            d = json.loads(text)
            if isinstance(d, dict):
                if self.is_derived(archive) and d.get("derived_revision") != DERIVED_REVISION:
                    return "", None
                return str(d.get("sha256", "")), d.get("stamp")
        return ("", None) if self.is_derived(archive) else (text.strip(), None)

    def record_digest(self, archive: Path, digest: str) -> None:
        record = {"sha256": digest, "stamp": file_stamp(archive)}
        if self.is_derived(archive):
            record["derived_revision"] = DERIVED_REVISION
        atomic_write_json(self.digest_path(archive), record)

    def params_digests(self, submodule: str) -> list[str]:
        """The recorded sha256 of each of submodule's archives ("" where not written yet)."""
        return [self.recorded_digest(a)[0] for a in self.param_archives(submodule)]

    def archive_intact(self, archive: Path) -> str:
        """archive's recorded sha256 if the file still has it, else "": checked by its stamp
        (size, mtime, ctime, inode), hashing again only when that changed."""
        digest, stamp = self.recorded_digest(archive)
        if not digest or not archive.is_file():
            return ""
        if stamp == file_stamp(archive):
            return digest
        if sha256_file(archive) != digest:
            self.r.say(f"{archive} is truncated or changed since it was written: writing it again")
            return ""
        self.record_digest(archive, digest)
        return digest

    def ensure_params(self, submodule: str) -> list[tuple[Path, str]]:
        """Write whichever of submodule's archives are missing or damaged; [(path, sha256)]."""
        from .exporters import COMPONENTS
        from .exporters.base import save_parameters

        out = []
        for i, path in enumerate(self.param_archives(submodule)):
            digest = self.archive_intact(path)
            if digest:
                self.r.reused("parameters", path.stem, "shared archive exists")
                out.append((path, digest))
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            xplan = self.export_plan(submodule)
            with self.r.stage("parameters", path.stem):
                with atomic_path(path) as tmp:
                    try:
                        save_parameters(
                            xplan.params_module,
                            tmp,
                            derived=i > 0,
                            source=self.weight_source(COMPONENTS[submodule]),
                        )
                    except (RuntimeError, OSError) as e:
                        # named by the archive's path (a write's OSError names no file), so
                        # the message says the cache is full, not the output folder
                        if DISK_FULL.search(str(e)):
                            raise OSError(errno.ENOSPC, str(e), str(path)) from None
                        raise
                digest = sha256_file(path)
                self.record_digest(path, digest)
            out.append((path, digest))
        return out
