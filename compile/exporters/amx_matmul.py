"""A bf16 matmul traced as a dispatch to sdiree's AMX kernel (specs/kernels/amx_bf16_matmul.c).

iree 3.13 has no AMX ukernel: on a CPU with AMX its bf16 matmuls run on avx512_bf16 dot products
at about the fp32 rate, while AMX's tiles do 16x16x32 products a few cycles each (one
8192x320 @ 320x1280 matmul: iree bf16 106 ms, fp32 71 ms, this kernel 10.5 ms; compile/NOTES.md,
"AMX"). `amx_matmul(a, b)` is an iree-turbine custom op whose MLIR is a `flow.dispatch` to a
`stream.executable` that calls the kernel, its object (compile/kernel_objects.py) named as a
`hal.executable.object`: iree links it into the module, and nothing else of the graph changes.

a is [M, K] bf16, b the weight packed for AMX's B operand ([N / 16, K / 2, 16, 2] bf16, `pack_b`
of a Linear's [N, K] weight: a transpose and a cast of a parameter, which iree hoists into the
parameter encoder, so the encoded archive holds it and no call pays for it), and the result
[M, N] float32 (products of bf16 inputs summed in fp32). M, N and K must be multiples of 32
(`fits`); eagerly (tests, shape probes) the op is the same product in torch.

Export choice `amx_operands: bf16x3` (`set_split` marks a model's modules; every AMX op of a
marked module takes `split`): each operand an f32 value as the sum of two bf16 parts, hi + lo,
side by side along K (`operand`, `weight_operand`: the same bytes as f32), and each product
A_hi B_hi + A_hi B_lo + A_lo B_hi (the kernels' sdiree_dp3_32x32): results of fp32's class
(the SD 1.5 UNet call 1.6e-5 from torch fp32; iree's fp32 build 1.2e-5, bf16 operands 8e-3)
at a third of AMX's bf16 rate, still several times AVX-512's f32 one (compile/NOTES.md).
"""

from __future__ import annotations

import torch

KERNEL = "amx_bf16_matmul"
# AVX-512 with bf16 conversions and dot products: the kernels' epilogues, and on a CPU without AMX
# their products too
AVX512_FLAGS = ("-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
# the kernels' instruction sets, export choice `kernel_isa`: {isa: C compiler flags}. `amx`: the
# 32x32 blocks on AMX's tiles (every CPU with AMX has the AVX-512 too); `avx512_bf16`: the same
# kernels with their blocks in L1 and vdpbf16ps products (kernels/amx_support.h), for a CPU with
# avx512_bf16 and no AMX (AMD Zen 4 and 5)
KERNEL_ISAS = {
    "amx": ("-mamx-tile", "-mamx-bf16", *AVX512_FLAGS),
    "avx512_bf16": ("-DSDIREE_KERNEL_AVX512", *AVX512_FLAGS),
}
# the instruction set this process's traces link (set_kernel_isa, before an export)
_isa = ["amx"]


def set_kernel_isa(isa: str) -> None:
    """The kernel objects that the kernel ops traced from now on link (export choice
    `kernel_isa`)."""
    if isa not in KERNEL_ISAS:
        raise ValueError(f"kernel_isa {isa!r}: one of {', '.join(KERNEL_ISAS)}")
    _isa[0] = isa


def current_kernel_isa() -> str:
    return _isa[0]


# one workgroup's block of C: the kernel's SDIREE_AMX_MB x SDIREE_AMX_NB (its defaults, the conv's
# and GEGLU's)
BLOCK_M, BLOCK_N = 128, 64
# the matmul's block where its weight is at most WIDE_MAX_WEIGHT elements (block_for)
WIDE_BLOCK = (64, 256)
WIDE_MAX_WEIGHT = 640 * 640
MULTIPLE = 32


def block_for(k: int, n: int) -> tuple[int, int]:
    """The matmul's workgroup block (rows, columns) for a [*, k] x [k, n] product: a small weight
    (SD 1.5's 320- and 640-wide linears) in wide blocks walked by rows, its A rows staying in L1
    while B streams from L2; a larger one in the default blocks walked by B strips. One core,
    kernel alone: 8192x320x1280 1.57 -> 1.85 TFLOPS, 2048x640x640 1.37 -> 1.60, 8192x320x320
    1.60 -> 1.74; 512x1280x1280 would drop 1.34 -> 1.12 (compile/NOTES.md)."""
    return WIDE_BLOCK if k * n <= WIDE_MAX_WEIGHT else (BLOCK_M, BLOCK_N)


def fits(m, n: int, k: int) -> bool:
    """Whether an [m, k] x [k, n] matmul can go to the kernel (m a traced size: an int when
    static)."""
    return isinstance(m, int) and all(d % MULTIPLE == 0 and d > 0 for d in (m, n, k))


def row_pad(m) -> int:
    """Zero rows that make an [m, k] operand's rows a multiple of the kernel's: fewer than m
    (m at least MULTIPLE); 0 where m is not static or is a multiple already."""
    return -m % MULTIPLE if isinstance(m, int) and m >= MULTIPLE else 0


def fits_padded(m, n: int, k: int) -> bool:
    """fits() once the rows are padded (row_pad): SD 2.1's unguided call at 768² has 144
    Winograd tiles and 144 pixels at its 24² and 12² levels, which iree multiplied itself
    from an f32 copy of their weights packed beside the kernel's (2.5 GB more archive)."""
    return fits(m + row_pad(m), n, k)


def padded_matmul(
    a: torch.Tensor, packed: torch.Tensor, split: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """amx_matmul on a's rows (dim -2) padded with zeros to the kernel's multiple, the padding's
    rows dropped from the result."""
    m = a.shape[-2]
    pad = row_pad(m)
    if pad:
        a = torch.nn.functional.pad(a, (0, 0, 0, pad))
    y = amx_matmul(a, packed, split, bias)
    return y[..., :m, :] if pad else y


def pack_b(weight: torch.Tensor) -> torch.Tensor:
    """A Linear's weight [..., N, K] as the kernel's B operand [..., N / 16, K / 2, 16, 2], in
    bf16 (leading dims kept: one operand per head)."""
    *lead, n, k = weight.shape
    w = weight.reshape(*lead, n // 16, 16, k // 2, 2)
    return w.transpose(-3, -2).to(torch.bfloat16)


def unpack_b(packed: torch.Tensor) -> torch.Tensor:
    """pack_b's operand back as [..., K, N] (the eager product's right operand)."""
    *lead, j, k2, _, _ = packed.shape
    return packed.permute(*range(len(lead)), -3, -1, -4, -2).reshape(*lead, k2 * 2, j * 16)


def amx_matmul(
    a: torch.Tensor, packed: torch.Tensor, split: bool = False, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """a [M, K] bf16 times pack_b's operand: [M, N] float32; or a batch of them, a [B, M, K]
    and pack_b's operand of a [B, N, K] weight (one dispatch, the batch its grid's third axis).
    With split, both are hi and lo parts side by side (operand, weight_operand). With a bias
    [N], every row of the result starts from it (the kernel's accumulators are loaded with it:
    no pass of the graph adds it). `register()` first, outside a trace: dynamo cannot trace the
    op's registration."""
    if bias is None:
        return _OP(a, packed, int(split))
    return _OP_BIAS(a, packed, bias.float(), int(split))


AMX_OPERANDS = ("bf16", "bf16x3")  # export choice `amx_operands`
SPLIT_MARK = "sdiree_amx_split"


def set_split(model: torch.nn.Module) -> None:
    """Mark every module of model for `amx_operands: bf16x3` (is_split)."""
    for m in model.modules():
        setattr(m, SPLIT_MARK, True)


def is_split(module) -> bool:
    return bool(getattr(module, SPLIT_MARK, False))


def operand(x: torch.Tensor, split: bool, dim: int = -1) -> torch.Tensor:
    """x as a kernel's bf16 operand: cast, or with split its hi and lo parts concatenated along
    dim (K). A bf16 x is one already (a norm or GEGLU kernel's result) and is returned as is."""
    if x.dtype == torch.bfloat16:
        return x
    if not split:
        return x.to(torch.bfloat16)
    x = x.float()
    # hi = x rounded to bf16 (to nearest, ties to even) on the bits: iree 3.13 folds the
    # x - f32(bf16(x)) of a cast pair to 0 in some graphs (the attention's scaled queries)
    bits = x.view(torch.int32)
    hi = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).view(torch.float32)
    return torch.cat([hi.to(torch.bfloat16), (x - hi).to(torch.bfloat16)], dim=dim)


def weight_operand(w: torch.Tensor, split: bool, dim: int = -1) -> torch.Tensor:
    """A weight [..., N, K] before pack_b: as it is, or with split its hi and lo parts along K
    (dim): pack_b then packs [hi | lo] along K, as the kernels read it."""
    return operand(w, True, dim) if split else w


def from_operand(x: torch.Tensor, split: bool) -> torch.Tensor:
    """An operand back in f32 (hi + lo with split)."""
    if not split:
        return x.float()
    k = x.shape[-1] // 2
    return x[..., :k].float() + x[..., k:].float()


def product(a: torch.Tensor, b: torch.Tensor, split: bool) -> torch.Tensor:
    """The kernels' a [.., M, K] x b [.., K, N] in torch (eager ops): with split, the three
    products of the parts."""
    if not split:
        return a.float() @ b.float()
    k = a.shape[-1] // 2
    a_hi, a_lo, b_hi, b_lo = (
        a[..., :k].float(),
        a[..., k:].float(),
        b[..., :k, :].float(),
        b[..., k:, :].float(),
    )
    return a_hi @ b_lo + a_hi @ b_hi + a_lo @ b_hi


class KernelOp:
    """A hand-written kernel's custom op, made and registered with torch once a process by
    `register()`, which must come before a trace (dynamo cannot trace the registration)."""

    def __init__(self, name: str, make):
        self.name, self.make, self.op = name, make, None

    def register(self) -> None:
        if self.op is None:
            self.op = self.make()

    def __call__(self, *args):
        if self.op is None:
            raise RuntimeError(f"{self.name}: call register() before tracing")
        return self.op(*args)


_OP = KernelOp("amx_matmul", lambda: _make_op(False))
_OP_BIAS = KernelOp("amx_matmul_bias", lambda: _make_op(True))


def register() -> None:
    """The matmul ops, without and with a bias (before a trace)."""
    _OP.register()
    _OP_BIAS.register()


# What every template of a hand-written kernel starts with: the module, and the stream executable
# naming the kernel's object for every x86-64 llvm-cpu target (no configuration: it matches the
# host's and any named CPU's).
TEMPLATE_HEAD = """
#x86 = #hal.executable.target<"llvm-cpu", "embedded-elf-x86_64">
module {{
  stream.executable private @{name}_exe attributes {{hal.executable.objects =
      #hal.executable.objects<{{#x86 = [#hal.executable.object<{{path = "{path}"}}>]}}>}} {{
"""


# The export of a kernel whose workgroup grid is (N / block_n, M / block_m): a 2-D matmul's.
GRID_MN = """    stream.executable.export public @{name} workgroups(%m: index, %n: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_n})>()[%n]
      %y = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_m})>()[%m]
      %c1 = arith.constant 1 : index
      stream.return %x, %y, %c1 : index, index, index
    }}
"""


def buffer_views(*views: tuple[str, str, str]) -> str:
    """Template lines (braces doubled, for str.format) that give each binding %<b> (binding,
    element type, the SSA value of its element count) as the base pointer %<b>_base and element
    offset %<b>_off that a bare-pointer kernel function takes."""
    lines = []
    for b, elem, count in views:
        lines += [
            f"        %{b}_m = stream.binding.subspan %{b}[%c0] : !stream.binding"
            f" -> memref<?x{elem}>{{{{%{count}}}}}",
            f"        %{b}_base, %{b}_off, %{b}_size, %{b}_stride ="
            f" iree_codegen.extract_strided_metadata %{b}_m",
            f"            : memref<?x{elem}> -> memref<{elem}>, index, index, index",
        ]
    return "\n".join(lines) + "\n"


def optional_operand(name: str, present: bool, count: str, type_: str, stand_in: str) -> dict:
    """The template values of a kernel op's optional f32 operand `name` (of tensor type type_,
    its element count the SSA value count): its binding, view, pointer and offset (stand_in's
    in their place without one: never read), parameter, operand and type."""
    view = buffer_views((name, "f32", count)).replace("{{", "{").replace("}}", "}")
    return {
        f"{name}_arg": f"%{name}: !stream.binding, " if present else "",
        f"{name}_view": view if present else "",
        f"{name}_base": f"%{name if present else stand_in}_base",
        f"{name}_off": f"%{name if present else stand_in}_off",
        f"{name}_param": f", %{name}: {type_}" if present else "",
        f"{name}_operand": f"%{name}, " if present else "",
        f"{name}_type": f"{type_}, " if present else "",
    }


def residual_values(has_res: bool, res_type: str) -> dict:
    """The template values of a kernel op whose `res` operand (of res_type, after `add`) is
    optional (optional_operand; add's pointer in its place without one)."""
    return optional_operand("res", has_res, "SO", res_type, "add")


# One template for a matmul and a batch of them: the grid's z axis walks the batch (1 for a
# single matmul), each workgroup's operands offset to its batch element's matrices.
_TEMPLATE = (
    TEMPLATE_HEAD
    + """    stream.executable.export public @{name} workgroups(%m: index, %n: index, %b: index)
        -> (index, index, index) {{
      %x = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_n})>()[%n]
      %y = affine.apply affine_map<()[s0] -> (s0 ceildiv {block_m})>()[%m]
      stream.return %x, %y, %b : index, index, index
    }}
    builtin.module {{
      func.func private @sdiree_amx_bf16_matmul_workgroup(memref<bf16>, index, memref<bf16>,
          index, memref<f32>, index, index, memref<f32>, index, index, index, index, index,
          index, index, index, index) -> i32 attributes {{hal.import.static, llvm.bareptr = true}}
      func.func @{name}(%a: !stream.binding, %b: !stream.binding, {bias_arg}%c: !stream.binding,
          %B: index, %M: index, %N: index, %K: index) {{
        %c0 = arith.constant 0 : index
        %wn = stream.dispatch.workgroup.id[0] : index
        %wm = stream.dispatch.workgroup.id[1] : index
        %wb = stream.dispatch.workgroup.id[2] : index
        %ea = arith.muli %M, %K : index
        %eb = arith.muli %N, %K : index
        %ec = arith.muli %M, %N : index
        %sa = arith.muli %ea, %B : index
        %sb = arith.muli %eb, %B : index
        %sc = arith.muli %ec, %B : index
"""
    + buffer_views(("a", "bf16", "sa"), ("b", "bf16", "sb"), ("c", "f32", "sc"))
    + """{bias_view}        %da = arith.muli %wb, %ea : index
        %db = arith.muli %wb, %eb : index
        %dc = arith.muli %wb, %ec : index
        %ao = arith.addi %a_off, %da : index
        %bo = arith.addi %b_off, %db : index
        %co = arith.addi %c_off, %dc : index
        %mb = arith.constant {block_m} : index
        %nb = arith.constant {block_n} : index
        %split = arith.constant {split} : index
        %has_bias = arith.constant {has_bias} : index
        %r = func.call @sdiree_amx_bf16_matmul_workgroup(%a_base, %ao, %b_base, %bo,
            {bias_base}, {bias_off}, %has_bias, %c_base, %co, %M, %N, %K, %mb, %nb, %split, %wn,
            %wm) : (memref<bf16>, index, memref<bf16>, index, memref<f32>, index, index,
            memref<f32>, index, index, index, index, index, index, index, index, index) -> i32
        return
      }}
    }}
  }}
  util.func private @{name}(%a: {a_type}, %b: {b_type}{bias_param}) -> {c_type} {{
    %bt = arith.constant {bt} : index
    %m = arith.constant {m} : index
    %n = arith.constant {n} : index
    %k = arith.constant {k} : index
    %0 = flow.dispatch @{name}_exe::@{name}[%m, %n, %bt](%a, %b, {bias_operand}%bt, %m, %n, %k)
        : ({a_type}, {b_type}, {bias_type}index, index, index, index) -> {c_type}
    util.return %0 : {c_type}
  }}
}}
"""
)


def object_path(kernel: str = KERNEL, isa: str | None = None) -> str:
    """A kernel's object for isa (set_kernel_isa's where None), built once into the user cache
    (compile/kernel_objects.py)."""
    from ..kernel_objects import build_object

    return str(build_object(kernel, KERNEL_ISAS[isa or _isa[0]]))


def select_static(ksel, tensors: int, attrs: int, result) -> None:
    """A kernel op's `select`: its first `tensors` arguments with every dim static, then its
    result, static too: result(argument shapes, *the int attributes after them) -> (shape,
    dtype)."""
    args = [ksel.arg_tensor(i) for i in range(tensors)]
    for a in args:
        a.specialize_all_dims()
    values = [ksel.attr_int(tensors + i).v for i in range(attrs)]
    shape, dtype = result([list(a.t.shape) for a in args], *values)
    ksel.return_new_tensor(shape, dtype).specialize_all_dims()


def emit_call(
    loader, kb, kernel: str, name: str, tensors: int, path: str | None = None, **values
) -> None:
    """A kernel op's `generate`: the template formatted with values, linking kernel's object
    (path, else object_path(kernel)), called on the op's first `tensors` arguments."""
    from iree.turbine.runtime.op_reg import impl_helper

    func = loader.inline_template_function(
        kb, kernel, name, name=name, path=path or object_path(kernel), **values
    )
    kb.yield_results(*impl_helper.call_function(func, *kb.arg_bindings[:tensors]))


def template_loader(template: str):
    """An iree-turbine TemplateLoader that formats `template` with a kernel's arguments (the
    MLIR bindings made fit for turbine first)."""
    from iree.turbine.runtime.op_reg import impl_helper

    _mlir_binding_compat()

    class _Loader(impl_helper.TemplateLoader):
        def load_template(self, kb, template_name: str, **kwargs):
            return self._parse_module_asm(kb, template.format(**kwargs))

    return _Loader()


def _mlir_binding_compat() -> None:
    """iree-turbine 3.9's custom-op expansion calls `IntegerType.isinstance(t)` and the like,
    which iree 3.13's MLIR bindings no longer have (`isinstance(t, IntegerType)` instead)."""
    from iree.compiler import ir

    for name in ("IntegerType", "RankedTensorType", "IndexType", "OpResult", "BlockArgument"):
        cls = getattr(ir, name, None)
        if cls is not None and not hasattr(cls, "isinstance"):
            cls.isinstance = staticmethod(lambda t, cls=cls: isinstance(t, cls))


def _bias_values(has_bias: bool, n: int) -> dict:
    """The template values of the matmul's optional bias operand ([N] f32; C's pointer in its
    place without one)."""
    return {
        "has_bias": int(has_bias),
        **optional_operand("bias", has_bias, "N", f"tensor<{n}xf32>", "c"),
    }


def _make_op(has_bias: bool):
    from iree.turbine.runtime.op_reg import CustomOp, def_library
    from iree.turbine.support.ir_imports import RankedTensorType

    loader = template_loader(_TEMPLATE)
    tensors = 3 if has_bias else 2
    if has_bias:
        name, sig, lib = "amx_bf16_matmul_bias", "Tensor a, Tensor b, Tensor bias", "sdiree_amx_b"
    else:
        name, sig, lib = "amx_bf16_matmul", "Tensor a, Tensor b", "sdiree_amx"

    class amx_bf16_matmul_op(CustomOp):
        signature = f"{name}({sig}, int split) -> (Tensor)"

        def select(self, ksel):
            select_static(
                ksel, tensors, 1, lambda s, _: ([*s[0][:-1], s[1][-4] * 16], torch.float32)
            )

        def eager_execute(self, a, b, *rest):
            *bias, split = rest
            c = product(a, unpack_b(b), bool(split))
            return c + bias[0] if bias else c

        def generate(self, ksel, kb):
            *batch, m, k = RankedTensorType(kb.arg_bindings[0].type).shape
            j, k2 = RankedTensorType(kb.arg_bindings[1].type).shape[-4:-2]
            lead = "".join(f"{d}x" for d in batch)
            split = ksel.arg_descs[tensors].v
            # by the operand's whole depth: split, A's rows are twice as long (both parts),
            # and the wide block's A rows no longer stay in L1 past 320 deep (SD 1.5's fp32
            # UNet call x0.958 against blocks by the real K, compile/NOTES.md)
            block_m, block_n = block_for(k, j * 16)
            emit_call(
                loader,
                kb,
                KERNEL,
                f"sdiree_amx_matmul_{lead}{m}x{k}x{j * 16}{'s' if split else ''}"
                f"{'b' if has_bias else ''}",
                tensors,
                **_bias_values(has_bias, j * 16),
                block_m=block_m,
                block_n=block_n,
                split=split,
                bt=batch[0] if batch else 1,
                m=m,
                k=k,
                n=j * 16,
                a_type=f"tensor<{lead}{m}x{k}xbf16>",
                b_type=f"tensor<{lead}{j}x{k2}x16x2xbf16>",
                c_type=f"tensor<{lead}{m}x{j * 16}xf32>",
            )

    return CustomOp.register(library=def_library(lib))(amx_bf16_matmul_op)
