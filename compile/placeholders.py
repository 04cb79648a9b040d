"""Shape-only parameters: a model whose weights are never read, for tracing it.

torch.export fakifies a module's parameters and the parameters are externalized
(`#flow.parameter.named`), so the export needs their names, shapes and dtypes, never their
values. A placeholder is an uninitialized CPU tensor (`torch.empty`): the allocator maps its
pages lazily and nothing writes them, so it costs address space, not memory. (Meta tensors would
say so more plainly, but torch.export cannot mix meta parameters with CPU inputs.) The values are
written to the parameter archives from the model's files instead (compile/weight_source.py).

Casting a placeholder (`module.to(torch.float16)`) under `casts_stay_placeholders()` makes a new
placeholder of the new dtype instead of writing a converted copy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode

_MARK = "_sdiree_placeholder"


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized tensor of shape and dtype, marked as a placeholder."""
    t = torch.empty(tuple(shape), dtype=dtype)
    setattr(t, _MARK, True)
    return t


def mark(t: torch.Tensor) -> torch.Tensor:
    """Mark t (a Parameter whose data is a placeholder) as one; returns t."""
    setattr(t, _MARK, True)
    return t


def is_placeholder(t: torch.Tensor) -> bool:
    return bool(getattr(t, _MARK, False))


def replace_parameters(module: torch.nn.Module) -> int:
    """Give every parameter of module a placeholder of its shape and dtype as its data (the
    Parameter objects, and so the state-dict names, stay); returns how many. Buffers keep their
    values: they are small, and the export reads non-persistent ones (CLIP's position ids)."""
    count = 0
    for p in module.parameters():
        p.data = placeholder(p.shape, p.dtype)
        mark(p)
        count += 1
    return count


class _CastsStayPlaceholders(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.to and args and is_placeholder(args[0]):
            device, dtype, _, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is None or device.type == "cpu":
                return placeholder(args[0].shape, dtype or args[0].dtype)
        return func(*args, **kwargs)


@contextlib.contextmanager
def casts_stay_placeholders() -> Iterator[None]:
    """Within the block, `Tensor.to` on a placeholder returns a placeholder (no copy made)."""
    with _CastsStayPlaceholders():
        yield
