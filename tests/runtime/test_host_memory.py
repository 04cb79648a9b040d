"""host_memory: with the setting on, a freed large block is reused without new page faults."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

# Faults taken by the second of two malloc/touch/free rounds of a 64 MiB block (16384 pages),
# in a fresh process so no other test's heap setting leaks in.
PROBE = """
import ctypes, json, resource, sys
from sdiree.runtime import host_memory
applied = host_memory.keep_freed_host_memory() if sys.argv[1] == "keep" else None
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
n = 64 << 20
for round in range(2):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    libc.free(ctypes.c_void_p(p))
print(json.dumps({"applied": applied, "faults": faults}))
"""


def probe(mode: str, **env) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **env},
    )
    return json.loads(out.stdout)


def test_freed_block_is_reused_without_faults():
    default = probe("default")
    kept = probe("keep")
    assert kept["applied"] is True
    assert default["faults"] > 8000  # glibc unmapped the block, the next one faults again
    assert kept["faults"] < 800


def test_opt_out_leaves_glibc_alone():
    out = probe("keep", SDIREE_HOST_HEAP="default")
    assert out["applied"] is False
    assert out["faults"] > 8000


def test_cpu_session_applies_it(compiled):
    art = compiled.get("cpu", "host", "fp32")
    code = (
        "import sys; from pathlib import Path\n"
        "from sdiree.runtime import host_memory\n"
        "from sdiree.runtime.device import list_devices\n"
        "from sdiree.runtime.manifest import load_manifest\n"
        "from sdiree.runtime.session import Session\n"
        "Session(load_manifest(Path(sys.argv[1])), list_devices('local-task')[0], ['unet'])\n"
        "print(host_memory._applied)\n"
    )
    out = subprocess.run([sys.executable, "-c", code, str(art)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"
