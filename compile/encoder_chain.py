"""Split a long encoder function into a chain of functions that iree 3.13 can compile.

The encoder module that iree-compile writes (`--iree-parameter-encoder-output-file`) encodes
the weights in one function, as a single chain of steps: each step allocates a transient
buffer, loads one parameter, runs its encoding dispatch, scatters the result into the output
archive and frees the buffer, all awaiting the previous step's `stream.resource.dealloca`. The
stream phase's fixed-point pipeline (IPO, cleanups and `ElideTimepoints`, at most 10 rounds)
does not settle on a chain that long: SDXL's UNet for cpu (2,182 steps) fails with "maximum
iteration count exceeded in fixed point pipeline", while its first 1,091 steps alone compile
(compile/NOTES.md). SD 1.5's and SD 2.1's encoders have shorter chains and compile as written.

So where the chain has more than MAX_STEPS steps (or it fails to compile on the fixed point),
every PART_STEPS steps after the first part go into a private function of their own that
takes the previous step's timepoint and returns its last one (`inlining_policy =
#util.inline.never`, or the stream phase's inliner would put them back), called one after the
other from the encode function; while iree-compile still fails on the fixed point the parts are
halved (the bound is not a plain chain length: one chain of 1,091 steps compiled, four parts of
550 did not). The constants a part uses (buffer
names, sizes, offsets, the transient sizes of `stream.resource.pack`) are pure and are copied
into it; the timepoint is the only value that crosses. The steps, their order and their
dependencies are unchanged, so the encoder writes the same bytes
(tests/compile/test_encoder_chain.py compares the outputs of a split and an unsplit encoder).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

# Measured on SDXL's cpu UNet encoder: 2,182 steps in one chain fail, its first 1,091 alone
# compile, and split into parts of 500 and 250 it compiles, of 550 not. SD 1.5's encoder (~11.5 GB
# out, ~1,050 steps at SDXL's ~11 MB a step) always compiled as written.
MAX_STEPS = 1100  # chains up to this long are compiled as they are (and split if that fails)
PART_STEPS = 250

_NAME = re.compile(r"%[A-Za-z0-9_$.]+")
# ops the parts may copy: no side effects, results depend only on their operands
_PURE = ("arith.constant", "util.buffer.constant", "stream.resource.pack", "arith.addi")


class ChainError(ValueError):
    """The encoder function does not have the shape this module splits."""


@dataclass
class _Op:
    lines: list[str]
    defs: list[str] = field(default_factory=list)
    uses: list[str] = field(default_factory=list)


def _op(lines: list[str]) -> _Op:
    first = lines[0]
    lhs, sep, _ = first.partition(" = ")
    defs = []
    if sep and lhs.strip().startswith("%"):
        defs = [re.sub(r":\d+$", "", n.strip()) for n in lhs.split(",")]
        body = first[len(lhs) + len(sep) :] + "\n" + "\n".join(lines[1:])
    else:
        body = "\n".join(lines)
    uses = [u for u in dict.fromkeys(_NAME.findall(body.replace("#", " #"))) if u not in defs]
    return _Op(lines, defs, uses)


def _parse_body(lines: list[str]) -> list[_Op]:
    """The ops of a function body: an op starts at 4 spaces of indentation; deeper lines and
    lines closing one of its regions belong to it."""
    ops: list[_Op] = []
    current: list[str] = []
    for line in lines:
        starts = line.startswith("    ") and not line.startswith("     ")
        if starts and not line[4:].startswith("}") and current:
            ops.append(_op(current))
            current = []
        current.append(line)
    if current:
        ops.append(_op(current))
    return ops


def _function_span(lines: list[str]) -> tuple[int, int]:
    """(index of the encode function's first line, index of its closing brace)."""
    start = next(
        (i for i, ln in enumerate(lines)
         if ln.startswith("  util.func") and 'iree.encode.function = "encode"' in ln),
        None,
    )  # fmt: skip
    if start is None:
        raise ChainError("no encode function")
    end = next((i for i in range(start + 1, len(lines)) if lines[i] == "  }"), None)
    if end is None:
        raise ChainError("the encode function does not end")
    return start, end


def chain_steps(text: str) -> int:
    """How many steps (deallocations) the encode function's chain has."""
    lines = text.split("\n")
    start, end = _function_span(lines)
    return sum("= stream.resource.dealloca " in ln for ln in lines[start + 1 : end])


def split_chain(text: str, max_steps: int = MAX_STEPS, part_steps: int = PART_STEPS) -> str:
    """text (an encoder module) with its encode chain split into parts of part_steps steps,
    or text itself where the chain has at most max_steps steps."""
    lines = text.split("\n")
    start, end = _function_span(lines)
    ops = _parse_body(lines[start + 1 : end])
    ends = [i for i, op in enumerate(ops) if op.lines[0].lstrip().startswith("%")
            and "= stream.resource.dealloca " in op.lines[0]]  # fmt: skip
    if len(ends) <= max_steps:
        return text
    tail = ends[-1] + 1  # chain_external and the return stay in the encode function
    defined_by = {name: op for op in ops for name in op.defs}

    bounds = list(range(part_steps, len(ends), part_steps))  # step indices starting a part
    head_end = ends[bounds[0] - 1] + 1
    main_ops = list(ops[:head_end])
    parts = []
    for k, first_step in enumerate(bounds):
        last_step = min(first_step + part_steps, len(ends)) - 1
        lo, hi = ends[first_step - 1] + 1, ends[last_step] + 1
        carried = ops[ends[first_step - 1]].defs[0]
        result = ops[ends[last_step]].defs[0]
        body = ops[lo:hi]
        copied = _pure_closure(body, carried, defined_by)
        name = f"@__encode_parameters_part{k + 1}"
        fn = [
            f"  util.func private {name}({carried}: !stream.timepoint) -> !stream.timepoint "
            "attributes {inlining_policy = #util.inline.never} {",
            *(ln for op in copied for ln in op.lines),
            *(ln for op in body for ln in op.lines),
            f"    util.return {result} : !stream.timepoint",
            "  }",
        ]
        parts.append(fn)
        main_ops.append(_op([f"    {result} = util.call {name}({carried}) : "
                             "(!stream.timepoint) -> !stream.timepoint"]))  # fmt: skip
    main_ops.extend(ops[tail:])
    out = [*lines[: start + 1], *(ln for op in main_ops for ln in op.lines), lines[end]]
    for fn in parts:
        out.extend(fn)
    out.extend(lines[end + 1 :])
    return "\n".join(out)


def _pure_closure(body: list[_Op], carried: str, defined_by: dict[str, _Op]) -> list[_Op]:
    """The pure ops (in their original order) that define what body uses from outside it."""
    inside = {name for op in body for name in op.defs} | {carried}
    needed: dict[int, _Op] = {}
    todo = [u for op in body for u in op.uses if u not in inside]
    while todo:
        name = todo.pop()
        op = defined_by.get(name)
        if op is None:
            if name.startswith("%arg"):
                raise ChainError(f"a later step uses the function argument {name}")
            continue  # a symbol or attribute reference, not a value
        if id(op) in needed:
            continue
        kind = op.lines[0].partition(" = ")[2].split(" ", 1)[0]
        if kind not in _PURE:
            raise ChainError(f"a later step uses {name}, defined by {kind}")
        needed[id(op)] = op
        todo.extend(u for u in op.uses if u not in inside)
    order = {id(op): i for i, op in enumerate(defined_by.values())}
    return sorted(needed.values(), key=lambda op: order[id(op)])


FIXED_POINT = "maximum iteration count exceeded in fixed point pipeline"
MIN_PART_STEPS = 32


def compile_encoder(mlir: Path, vmfb: Path, flags: list[str], log: Path, compile_fn) -> int:
    """compile_fn(mlir, vmfb, flags, log) the encoder module at mlir; where its chain is longer
    than MAX_STEPS it is first split into parts of PART_STEPS, and while iree-compile fails on
    the fixed point the parts are halved (down to MIN_PART_STEPS), as where the bound lies is
    measured, not known: on SDXL's encoder parts of 500 steps went through, 550 did not. Returns
    the part size used (0: compiled as written). A module of another shape (a later iree) is
    compiled as written: iree-compile then says what it makes of it."""
    from sdiree.runtime.errors import UserError
    from sdiree.runtime.fileutil import atomic_write_bytes

    text = mlir.read_text()
    try:
        steps = chain_steps(text)
    except ChainError:
        steps = 0  # not a chain this module knows: compiled as written, never split
    part = PART_STEPS if steps > MAX_STEPS else 0
    while True:
        if part:
            try:
                atomic_write_bytes(mlir, split_chain(text, part, part).encode())
            except ChainError:
                part, steps = 0, 0
                atomic_write_bytes(mlir, text.encode())
        try:
            compile_fn(mlir, vmfb, flags, log)
            return part
        except UserError as e:
            if FIXED_POINT not in str(e) or steps < 2 or 0 < part <= MIN_PART_STEPS:
                raise
            part = part // 2 if part else min(PART_STEPS, steps // 2)
