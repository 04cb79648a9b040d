"""Export choice `linear: "f32"`: every nn.Linear whose output features are a multiple of 64
traced as one dispatch to sdiree's fp32 linear kernel (specs/kernels/f32_matmul.c, AVX-512 FMA),
its bias added by the kernel.

For cpu fp32 on AVX-512 CPUs without AMX (specs/targets.json `if_cpu_has.avx512f`): iree 3.13's
f32 matmul ukernel runs SD 1.5's UNet linears at ~65 % of a Zen 5's FMA peak in situ, after an
encoding dispatch that packs the activations; the kernel reads the activations as they are and
runs at 80-100 % of one core's peak alone (compile/NOTES.md). The weight is packed for it in the
graph ([N / 64, K, 64]: a reshape and transpose of the parameter, which iree's parameter encoder
computes at compile, as it does its own data-tiled packs), so no call pays for the packing.
Linears on fewer than MIN_ROWS rows (the time embedding's) keep their own forward.

A diffusers GEGLU whose projection fits is one dispatch to the kernel's GEGLU form (value times
the exact GELU of the gate, only the product written; the weight and bias packed with value and
gate panels interleaved).

Export choice `matmul_kernel: "f32"` sends the split Winograd convs' 2-D products (winograd.py
`_product`) and the im2col convs' matmuls (im2col.py: 1x1 and strided convs, and the plain 3x3
ones of `plain_from_downscale`, their bias in the epilogue) to the same kernel, the weight
packed likewise.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .amx_matmul import TEMPLATE_HEAD, KernelOp, buffer_views, emit_call, template_loader
from .geglu_amx import interleave

KERNEL = "f32_matmul"
ISA_FLAGS = ("-mavx512f",)  # what the kernel executes: AVX-512 Foundation's FMAs
CPU_FEATURES = ("avx512f",)
PANEL = 64  # the kernel's NR: the weight's columns a packed panel
MIN_ROWS = 8


def fits_linear(linear: torch.nn.Linear) -> bool:
    return linear.out_features % PANEL == 0 and linear.weight.dtype == torch.float32


def block_for(m: int, n: int) -> tuple[int, int]:
    """A workgroup's rows and columns: 96 x 256 (its A rows and one B strip in L2), 48 rows
    where the rows are few (the grid keeps both workers busy), all of them up to 96 (a text
    encoder's 77 tokens: each B strip read by one workgroup, the columns split the work; SD
    1.5's encode x0.90-0.93 on a Zen 5 against two 48-row blocks), the 320 and 640 wide outputs
    whole or in halves; a small odd grid's column blocks halved (an odd count leaves one
    worker idle for the last workgroup: 8 of 15 is 7 % lost)."""
    block_m = 96 if m >= 1024 else -(-m // 6) * 6 if m <= 96 else 48
    block_n = 320 if n % 320 == 0 and n <= 640 else 256 if n % 256 == 0 else PANEL
    count = -(-m // block_m) * -(-n // block_n)
    if count % 2 and count < 32 and block_n % (2 * PANEL) == 0:
        block_n //= 2
    return block_m, block_n


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A Linear's weight [N, K] as the kernel's B operand [N / 64, K, 64]."""
    n, k = weight.shape
    return weight.reshape(n // PANEL, PANEL, k).transpose(1, 2)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's operand back as [K, N] (the eager product's right operand)."""
    j, k, _ = packed.shape
    return packed.permute(1, 0, 2).reshape(k, j * PANEL)


def f32_forward(linear: torch.nn.Linear):
    """The forward to bind to linear under `f32` (the kernel's op registered)."""
    register()
    return _f32_forward


def _f32_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if not isinstance(rows, int) or rows < MIN_ROWS or x.dtype != torch.float32:
        return F.linear(x, self.weight, self.bias)
    bias = self.bias if self.bias is not None else torch.zeros(self.out_features)
    y = _OP(x2, pack(self.weight), bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def f32_matmul(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] (+ bias [N]) on the kernel, b packed in the graph (a constant
    expression where b is a parameter: a Winograd conv's transformed weight, a conv's weight);
    `register()` first."""
    n = b.shape[-1]
    packed = b.reshape(b.shape[0], n // PANEL, PANEL).permute(1, 0, 2)
    return _OP(a, packed, torch.zeros(n) if bias is None else bias)


def fits_matmul(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a [M, K] @ b [K, N] can go to the kernel (`matmul_kernel: f32`)."""
    rows = a.shape[0]
    return (
        a.dim() == 2
        and isinstance(rows, int)
        and rows >= MIN_ROWS
        and b.shape[-1] % PANEL == 0
        and a.dtype == b.dtype == torch.float32
    )


def geglu_forward(geglu: torch.nn.Module):
    """The forward to bind to a diffusers GEGLU whose projection fits the kernel under `f32`
    (the kernel's ops registered): the projection and the gate as one dispatch to the kernel's
    GEGLU form."""
    register()
    return _geglu_forward


def _geglu_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    proj = self.proj
    x2 = x.reshape(-1, x.shape[-1])
    rows, inner = x2.shape[0], proj.out_features // 2
    if not isinstance(rows, int) or rows < MIN_ROWS or inner % PANEL or x.dtype != torch.float32:
        value, gate = proj(x).chunk(2, dim=-1)
        return value * F.gelu(gate)
    bias = proj.bias if proj.bias is not None else torch.zeros(proj.out_features)
    # value and gate rows interleaved by panel: one packed panel of value, then its gate's
    y = _GEGLU(x2, pack(interleave(proj.weight, inner, PANEL)), interleave(bias, inner, PANEL))
    return y.reshape(*x.shape[:-1], inner)


def _eager_geglu(a, b, bias):
    y = a @ unpack(b) + bias
    j = y.shape[-1] // (2 * PANEL)
    pairs = y.reshape(-1, j, 2, PANEL)
    return (pairs[:, :, 0] * F.gelu(pairs[:, :, 1])).reshape(y.shape[0], j * PANEL)


_OP = KernelOp("f32_linear", lambda: _make_ops()[0])
_GEGLU = KernelOp("f32_geglu", lambda: _make_ops()[1])


def register() -> None:
    _OP.register()
    _GEGLU.register()


# The grid walks the row blocks fastest: the workgroups that follow each other share one strip
# of B, which stays in L2 while A's rows (which L3 holds) pass it; walked by column blocks, a
# 10240-wide weight was read from memory once per row block (SD 1.5's 16x16 GEGLU: 331 GF/s in
# situ on 2 Zen 5 cores, iree's own 347).
_GRID = """    stream.executable.export public @{name} workgroups(%m: index, %n: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_m})>()[%m]
      %y = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_n})>()[%n]
      %c1 = arith.constant 1 : index
      stream.return %x, %y, %c1 : index, index, index
    }}
"""

_TEMPLATE = (
    TEMPLATE_HEAD
    + _GRID
    + """    builtin.module {{
      func.func private @{workgroup}(memref<f32>, index, memref<f32>, index,
          memref<f32>, index, memref<f32>, index, index, index, index, index, index, index,
          index) -> i32 attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%a: !stream.binding, %b: !stream.binding, %bias: !stream.binding,
          %c: !stream.binding) {{
        %c0 = arith.constant 0 : index
        %wm = stream.dispatch.workgroup.id[0] : index
        %wn = stream.dispatch.workgroup.id[1] : index
        %M = arith.constant {m} : index
        %N = arith.constant {n} : index
        %K = arith.constant {k} : index
        %sa = arith.constant {sa} : index
        %sb = arith.constant {sb} : index
        %sc = arith.constant {sc} : index
        %sbias = arith.constant {sbias} : index
        %mb = arith.constant {block_m} : index
        %nb = arith.constant {block_n} : index
"""
    + buffer_views(
        ("a", "f32", "sa"), ("b", "f32", "sb"), ("bias", "f32", "sbias"), ("c", "f32", "sc")
    )
    + """        %r = func.call @{workgroup}(%a_base, %a_off, %b_base, %b_off,
            %bias_base, %bias_off, %c_base, %c_off, %M, %N, %K, %mb, %nb, %wn, %wm)
            : (memref<f32>, index, memref<f32>, index, memref<f32>, index, memref<f32>, index,
               index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%a: tensor<{m}x{k}xf32>, %b: tensor<{j}x{k}x64xf32>,
      %bias: tensor<{sbias}xf32>) -> tensor<{m}x{n}xf32> {{
    %m = arith.constant {m} : index
    %n = arith.constant {n} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m, %n](%a, %b, %bias)
        : (tensor<{m}x{k}xf32>, tensor<{j}x{k}x64xf32>, tensor<{sbias}xf32>) -> tensor<{m}x{n}xf32>
    util.return %0 : tensor<{m}x{n}xf32>
  }}
}}
"""
)


def object_path() -> str:
    """The kernel's object, built once into the user cache (compile/kernel_objects.py)."""
    from ..kernel_objects import build_object

    return str(build_object(KERNEL, ISA_FLAGS))


@functools.cache
def _make_ops():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)
    library = def_library("sdiree_f32_linear")

    def generate(kb, kind: str, columns: int) -> None:
        """a [M, K] @ b (j panels) + bias on the kernel's `kind` form, `columns` packed columns
        an output column."""
        m, k = RankedTensorType(kb.arg_bindings[0].type).shape
        j = RankedTensorType(kb.arg_bindings[1].type).shape[0]
        n = j * PANEL // columns
        block_m, block_n = block_for(m, n)
        emit_call(
            loader,
            kb,
            KERNEL,
            f"sdiree_f32_{kind}_{m}x{k}x{n}",
            3,
            path=object_path(),
            workgroup=f"sdiree_f32_{kind}_workgroup",
            m=m, n=n, k=k, j=j, sa=m * k, sb=j * PANEL * k, sc=m * n, sbias=j * PANEL,
            block_m=block_m, block_n=block_n,
        )  # fmt: skip

    def select(ksel, columns: int) -> None:
        args = [ksel.arg_tensor(i) for i in range(3)]
        for a in args:
            a.specialize_all_dims()
        m = args[0].t.shape[0]
        n = args[1].t.shape[0] * PANEL // columns
        ksel.return_new_tensor([m, n], torch.float32).specialize_all_dims()

    @CustomOp.register(library=library)
    class f32_linear(CustomOp):
        signature = "f32_linear(Tensor a, Tensor b, Tensor bias) -> (Tensor)"

        def select(self, ksel):
            select(ksel, 1)

        def eager_execute(self, a, b, bias):
            return a @ unpack(b) + bias

        def generate(self, ksel, kb):
            generate(kb, "linear", 1)

    @CustomOp.register(library=library)
    class f32_geglu(CustomOp):
        signature = "f32_geglu(Tensor a, Tensor b, Tensor bias) -> (Tensor)"

        def select(self, ksel):
            select(ksel, 2)

        def eager_execute(self, a, b, bias):
            return _eager_geglu(a, b, bias)

        def generate(self, ksel, kb):
            generate(kb, "geglu", 2)

    return f32_linear, f32_geglu
