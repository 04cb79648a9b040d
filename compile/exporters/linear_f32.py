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

Export choice `matmul_kernel: "f32"` sends the split Winograd convs' 2-D products (winograd.py
`_product`) to the same kernel, the transformed weight packed likewise.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .amx_matmul import TEMPLATE_HEAD, KernelOp, buffer_views, emit_call, template_loader

KERNEL = "f32_matmul"
ISA_FLAGS = ("-mavx512f",)  # what the kernel executes: AVX-512 Foundation's FMAs
CPU_FEATURES = ("avx512f",)
PANEL = 64  # the kernel's NR: the weight's columns a packed panel
MIN_ROWS = 8


def fits_linear(linear: torch.nn.Linear) -> bool:
    return linear.out_features % PANEL == 0 and linear.weight.dtype == torch.float32


def block_for(m: int, n: int) -> tuple[int, int]:
    """A workgroup's rows and columns: 96 x 256 (its A rows and one B strip in L2), 48 rows
    where the rows are few (the grid keeps both workers busy), the 320 and 640 wide outputs
    whole or in halves."""
    block_n = 320 if n % 320 == 0 and n <= 640 else 256 if n % 256 == 0 else PANEL
    return (96 if m >= 1024 else 48), block_n


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


def f32_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] @ b [K, N] on the kernel, b packed in the graph (a constant expression where b
    is a parameter: a Winograd conv's transformed weight); `register()` first."""
    n = b.shape[-1]
    return _OP(a, b.reshape(b.shape[0], n // PANEL, PANEL).permute(1, 0, 2), torch.zeros(n))


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


_OP = KernelOp("f32_linear", lambda: _make_op())
register = _OP.register


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
      func.func private @sdiree_f32_linear_workgroup(memref<f32>, index, memref<f32>, index,
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
        %mb = arith.constant {block_m} : index
        %nb = arith.constant {block_n} : index
"""
    + buffer_views(("a", "f32", "sa"), ("b", "f32", "sb"), ("bias", "f32", "N"), ("c", "f32", "sc"))
    + """        %r = func.call @sdiree_f32_linear_workgroup(%a_base, %a_off, %b_base, %b_off,
            %bias_base, %bias_off, %c_base, %c_off, %M, %N, %K, %mb, %nb, %wn, %wm)
            : (memref<f32>, index, memref<f32>, index, memref<f32>, index, memref<f32>, index,
               index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%a: tensor<{m}x{k}xf32>, %b: tensor<{j}x{k}x64xf32>,
      %bias: tensor<{n}xf32>) -> tensor<{m}x{n}xf32> {{
    %m = arith.constant {m} : index
    %n = arith.constant {n} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m, %n](%a, %b, %bias)
        : (tensor<{m}x{k}xf32>, tensor<{j}x{k}x64xf32>, tensor<{n}xf32>) -> tensor<{m}x{n}xf32>
    util.return %0 : tensor<{m}x{n}xf32>
  }}
}}
"""
)


def object_path() -> str:
    """The kernel's object, built once into the user cache (compile/kernel_objects.py)."""
    from ..kernel_objects import build_object

    return str(build_object(KERNEL, ISA_FLAGS))


def _make_op():
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)

    @CustomOp.register(library=def_library("sdiree_f32_linear"))
    class f32_linear(CustomOp):
        signature = "f32_linear(Tensor a, Tensor b, Tensor bias) -> (Tensor)"

        def select(self, ksel):
            args = [ksel.arg_tensor(i) for i in range(3)]
            for a in args:
                a.specialize_all_dims()
            m = args[0].t.shape[0]
            n = args[1].t.shape[0] * PANEL
            ksel.return_new_tensor([m, n], torch.float32).specialize_all_dims()

        def eager_execute(self, a, b, bias):
            return a @ unpack(b) + bias

        def generate(self, ksel, kb):
            m, k = RankedTensorType(kb.arg_bindings[0].type).shape
            j = RankedTensorType(kb.arg_bindings[1].type).shape[0]
            n = j * PANEL
            block_m, block_n = block_for(m, n)
            name = f"sdiree_f32_linear_{m}x{k}x{n}"
            emit_call(
                loader,
                kb,
                KERNEL,
                name,
                3,
                path=object_path(),
                m=m,
                n=n,
                k=k,
                j=j,
                sa=m * k,
                sb=n * k,
                sc=m * n,
                block_m=block_m,
                block_n=block_n,
            )

    return f32_linear
