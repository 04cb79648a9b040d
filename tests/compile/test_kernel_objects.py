"""compile/kernel_objects.py: a kernel's source hash (part of an export's cache key) covers the
headers its source includes, so editing a shared header rebuilds the object and exports again."""

from __future__ import annotations

from sdiree.compile import kernel_objects


def test_source_hash_covers_the_headers_beside_the_kernel(monkeypatch, tmp_path):
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "k.c").write_text('#include "shared.h"\nint f(void) { return SHARED; }\n')
    (kernels / "shared.h").write_text("#define SHARED 1\n")
    monkeypatch.setattr(kernel_objects, "default_specs_dir", lambda: tmp_path)
    first = kernel_objects.source_hash("k")
    assert kernel_objects.source_hash("k") == first
    (kernels / "shared.h").write_text("#define SHARED 2\n")
    second = kernel_objects.source_hash("k")
    assert second != first
    (kernels / "k.c").write_text('#include "shared.h"\nint f(void) { return -SHARED; }\n')
    assert kernel_objects.source_hash("k") not in (first, second)


def test_the_shipped_kernels_build_with_their_shared_header(monkeypatch, tmp_path):
    from sdiree.compile.exporters import amx_matmul, attention_amx

    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path))
    for name, flags in (
        (amx_matmul.KERNEL, amx_matmul.KERNEL_ISAS["amx"]),
        (attention_amx.KERNEL, amx_matmul.KERNEL_ISAS["amx"]),
    ):
        obj = kernel_objects.build_object(name, flags)
        assert obj.read_bytes()[:4] == b"\x7fELF"


def test_each_kernel_isa_builds_its_own_object(monkeypatch, tmp_path):
    """Export choice `kernel_isa`: the same kernels on AMX's tiles, or on AVX-512 bf16 dot
    products for a CPU without AMX (kernels/amx_support.h); two objects, and only the AMX one
    holds AMX instructions."""
    import shutil
    import subprocess

    from sdiree.compile.exporters import amx_matmul, attention_amx, group_norm_kernel

    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path))
    objdump = shutil.which("objdump")
    for name in (amx_matmul.KERNEL, attention_amx.KERNEL, group_norm_kernel.KERNEL):
        amx, avx = (
            kernel_objects.build_object(name, amx_matmul.KERNEL_ISAS[isa])
            for isa in ("amx", "avx512_bf16")
        )
        assert amx != avx and amx.read_bytes() != avx.read_bytes()
        if objdump and name != group_norm_kernel.KERNEL:  # the norms multiply nothing
            code = {
                o: subprocess.run([objdump, "-d", str(o)], capture_output=True, text=True).stdout
                for o in (amx, avx)
            }
            assert "tdpbf16ps" in code[amx] and "tdpbf16ps" not in code[avx]
            assert "vdpbf16ps" in code[avx] and "tile" not in code[avx]
