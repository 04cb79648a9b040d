"""runtime/cpu_features: this CPU's feature flags, which the cpu `host` preset's flags depend on."""

from __future__ import annotations

import platform

import pytest

from sdiree.runtime.cpu_features import host_cpu_features, parse_cpuinfo

X86 = """processor\t: 0
vendor_id\t: AuthenticAMD
flags\t\t: fpu sse2 avx avx2 fma avx512_bf16
bugs\t\t: sysret_ss_attrs

processor\t: 1
flags\t\t: fpu sse2
"""
ARM = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU implementer\t: 0x41\n"


def test_parse_cpuinfo_reads_the_first_processors_flags():
    assert parse_cpuinfo(X86) == {"fpu", "sse2", "avx", "avx2", "fma", "avx512_bf16"}
    assert "bf16" in parse_cpuinfo(ARM)
    assert parse_cpuinfo("processor : 0\nmodel name : x\n") == frozenset()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 feature names")
def test_host_features_on_x86_64_include_sse2():
    assert "sse2" in host_cpu_features()
