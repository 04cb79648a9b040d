"""The cpu text encoders on sdiree's kernels where a CPU without AMX has AVX-512: fp32 on the
fp32 linear kernel (`linear: f32`), bf16 on the matmul kernel's avx512_bf16 build (`linear:
amx`, `kernel_isa: avx512_bf16`); an AMX CPU keeps what it had (fp32 on iree's own path, bf16
on the AMX kernel), an AVX2 CPU iree's path. Why: tools/PERFORMANCE.md, seventy-second session."""

from __future__ import annotations

import dataclasses

import pytest

from sdiree.runtime.targets import Arch, load_registry

AVX512 = ("avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512vl")
CPUS = {
    "zen5": (*AVX512, "avx512_bf16"),
    "sapphirerapids": (*AVX512, "avx512_bf16", "amx_bf16", "amx_tile"),
    "zen3": ("avx2", "fma"),
}
WANT = {
    ("zen5", "fp32"): {"linear": "f32"},
    ("zen5", "bf16"): {"linear": "amx", "kernel_isa": "avx512_bf16"},
    ("sapphirerapids", "fp32"): {},
    ("sapphirerapids", "bf16"): {"linear": "amx"},
    ("zen3", "fp32"): {},
    ("zen3", "bf16"): {},
}


@pytest.mark.parametrize("cpu_name,dtype", sorted(WANT))
def test_text_encoders_take_the_kernels_per_cpu(cpu_name, dtype):
    cpu = load_registry().target("cpu")
    arch = Arch(name=cpu_name, description="", flags=(), cpu_features=CPUS[cpu_name])
    cpu = dataclasses.replace(cpu, arches={**cpu.arches, cpu_name: arch})
    for sub in ("text_encoder", "text_encoder_2"):
        got = cpu.export_for(sub, dtype, cpu_name)
        kernel = {k: got[k] for k in ("linear", "kernel_isa") if k in got}
        assert kernel == WANT[cpu_name, dtype], sub
