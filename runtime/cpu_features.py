"""This machine's CPU feature flags (Linux `/proc/cpuinfo` names: `avx2`, `avx512_bf16`, ...).

The cpu target's `host` preset compiles for the CPU it compiles on; presets whose flags depend on
what that CPU can do (tuned dtype paths, specs/README.md `flags_if_cpu_lacks`) read them here.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def parse_cpuinfo(text: str) -> frozenset[str]:
    """The feature flags of the first processor listed (x86 `flags`, Arm `Features`)."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


@lru_cache(maxsize=1)
def host_cpu_features() -> frozenset[str]:
    """This CPU's features; empty where /proc/cpuinfo cannot be read (every feature is then
    taken as missing, which picks the slower but always-correct flags)."""
    try:
        return parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        return frozenset()
