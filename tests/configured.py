"""What iree-compile configured each dispatch of an artifact's submodule with (its pipeline,
tiles and any tuning spec's marker), read from an artifact already built: the submodule's
exported MLIR (in $SDIREE_CACHE) is compiled again with the manifest's flags and tuning specs,
only to `--compile-to=executable-configurations`, which stops before code generation (11 s
for the tiny x86-64-v3 UNet alone, where its full compile took 115 s inside the suite). So a test can share an
artifact the suite builds anyway instead of building its own with a dump flag."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

DUMP_FLAG = "--iree-hal-dump-executable-configurations-to="


def dump_configurations(art: Path, submodule: str, dump: Path, specs: bool = True) -> Path:
    """Dump the configurations of art's submodule into dump (one .mlir per executable), as
    its compile configured them; with specs=False without the tuning spec a target takes in
    the module (compile/tuning_embed.py). Returns dump."""
    from sdiree.compile.iree_compile import UNTHREADED, iree_compile_tool
    from sdiree.compile.tuning_embed import with_spec
    from sdiree.runtime.fileutil import sha256_file
    from sdiree.runtime.targets import load_registry

    sub = json.loads((art / "manifest.json").read_text())["submodules"][submodule]
    mlir = next(Path(os.environ["SDIREE_CACHE"]).rglob(sub["mlir"]))
    flags = [f for f in sub["flags"] if not f.startswith(DUMP_FLAG)]
    if any("tuning-spec-path" in f for f in flags):  # can deadlock threaded (iree_compile.py)
        flags += UNTHREADED
    # a spec no flag names was attached to the module (compile/tuning_embed.py)
    attached = [rel for rel in sub["tuning_specs"] if not any(rel in f for f in sub["flags"])]
    assert len(attached) <= 1, attached
    spec = None
    if specs and attached:
        spec = load_registry().spec_path(attached[0])
        assert sha256_file(spec) == sub["tuning_specs"][attached[0]], "not the shipped spec"
    dump.mkdir(parents=True)
    with with_spec(mlir, spec, dump.parent) as src:
        cmd = [
            iree_compile_tool(), str(src), *flags, "--compile-to=executable-configurations",
            f"{DUMP_FLAG}{dump}", "-o", os.devnull,
        ]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return dump


def configurations(dump: Path) -> dict[str, str]:
    """{dispatch function name: its configured source} from a configuration dump."""
    out = {}
    for f in dump.glob("*.mlir"):
        text = f.read_text()
        for name in re.findall(r"func\.func @(\S+?)\(", text):
            out[name] = text
    return out
