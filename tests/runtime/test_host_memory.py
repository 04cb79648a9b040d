"""host_memory: with the runtime's setting on, a freed large block is reused without new page
faults; with the compile's, freed blocks go back to the system (and the trim returns the rest)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from sdiree.runtime import host_memory

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only"
)

# Faults taken by the second of two malloc/touch/free rounds of a 64 MiB block (16384 pages),
# in a fresh process so no other test's heap setting leaks in.
PROBE = """
import ctypes, json, resource, sys
from sdiree.runtime import host_memory
applied = host_memory.keep_freed_host_memory() if sys.argv[1] in ("keep", "keep-stage") else None
if sys.argv[1] == "keep-stage":  # a stage that keeps its heap, run by the runtime: no change
    with host_memory.freed_heap_kept() as kept:
        applied = applied and kept
if sys.argv[1] in ("inside", "after"):  # the compile's setting, then a stage that keeps its heap
    host_memory.map_large_blocks()
    kept = host_memory.freed_heap_kept()
    applied = kept.__enter__()
    if sys.argv[1] == "after":
        kept.__exit__(None, None, None)
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


def test_a_stage_keeps_its_freed_heap_and_maps_again_after():
    inside, after = probe("inside"), probe("after")
    assert inside["applied"] is True
    assert inside["faults"] < 800  # the freed block reused
    assert after["faults"] > 8000  # large blocks mapped (and unmapped when freed) again
    runtime = probe("keep-stage")  # where the runtime keeps its heap, it stays kept after
    assert runtime["applied"] is True and runtime["faults"] < 800


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


# In a fresh process: 256 MiB of blocks of SIZE bytes, all freed but the last, which pins the
# heap's top (without a trim or a mapping of their own they stay resident); prints what SETUP
# and THEN returned and the RSS before and after THEN.
RETURNED = """
import os
from sdiree.runtime import host_memory

def rss():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

print({setup})
blocks = [bytearray(os.urandom(16)) * ({size} // 16) for _ in range(2**28 // {size})]
last = blocks[-1]
del blocks
before = rss()
print({then}, before, rss())
"""


def returned(size: int, then: str = "None", setup: str = "None") -> tuple[str, str, int, int]:
    code = textwrap.dedent(RETURNED).format(size=size, then=then, setup=setup)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], out[1], int(out[2]), int(out[3])


def test_the_trim_returns_free_heap_pages():
    # 64 KiB blocks: below malloc's mmap threshold, carved from its heap
    _, trimmed, before, after = returned(2**16, "host_memory.release_freed_heap()")
    assert trimmed == "True"
    assert before - after > 128 * 2**20, (before, after)
    _, _, before, after = returned(2**16, "None")  # without it: kept
    assert before - after < 64 * 2**20, (before, after)


# A 2 MiB block mapped and freed first raises glibc's threshold to 2 MiB: the next 2 MiB blocks
# come from the heap and stay resident when freed.
RAISE = "bytearray(2**21)"


def test_large_blocks_are_mapped_and_handed_back_when_freed():
    _, _, kept, _ = returned(2**21, setup=f"len({RAISE}) and None")
    mapped, _, handed_back, _ = returned(
        2**21, setup=f"[host_memory.map_large_blocks(), {RAISE}][0]"
    )
    assert mapped == "True"
    assert kept - handed_back > 200 * 2**20, (kept, handed_back)


def test_map_large_blocks_opt_out(monkeypatch):
    monkeypatch.setenv("SDIREE_HOST_HEAP", "default")
    assert host_memory.map_large_blocks() is False
