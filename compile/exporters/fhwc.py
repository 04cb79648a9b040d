"""Convolutions on channels-last filters (export conv choice `pointwise_einsum_fhwc`).

cuda compiles its convolutions channels-last (iree's transpose-convolution preprocessing
pipeline: the SD 1.5 UNet call x0.82 on an H200). From torch's [O, C, kh, kw] filter that
pipeline makes an [O, kh, kw, C] one with a transpose of the weight, which IREE hoists into
the module's initializer, once per function that uses it: the UNet's unguided `denoise` and
guided `denoise_cfg` each load their own transposed copy (+1 GB of device memory at SD 1.5
size). Here each conv with a kernel larger than 1x1 gets its filter channels-last as a
parameter of its own (`<conv>.weight_fhwc`, saved to a derived archive beside the model's;
the runtime derives it again from replaced weights, runtime/weights/derived.py) and the trace
permutes it back, so the pipeline's transpose cancels that permute: the module reads the
parameter as it is, nothing is hoisted, and both functions share it. 1x1 convs are weight-first
einsums, as under `pointwise_einsum` (conv_matmul.py says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sdiree.runtime.weights.derived import FHWC_PARAM

from ..placeholders import is_placeholder, mark, placeholder
from .im2col import supported

DERIVED_TAG = "fhwc"  # the derived archive: <scope>.fhwc.irpa


def conv_on_fhwc_filter(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """conv's forward on its channels-last filter (a 1x1 stride-1 one as a weight-first
    einsum)."""
    from .conv_matmul import conv1x1_as_einsum  # here: conv_matmul imports this module

    w = getattr(conv, FHWC_PARAM, None)
    if w is None:
        return conv1x1_as_einsum(conv, x)
    return F.conv2d(x, w.permute(0, 3, 1, 2), conv.bias, conv.stride, conv.padding)


def add_fhwc_weights(model: torch.nn.Module) -> int:
    """Give every supported Conv2d of model with a kernel larger than 1x1 its filter as
    [O, kh, kw, C], a parameter of its own (`<conv>.weight_fhwc`); returns how many have one
    (a second call on the same model adds none)."""
    count = 0
    for mod in model.modules():
        if not (isinstance(mod, torch.nn.Conv2d) and supported(mod)):
            continue
        if tuple(mod.kernel_size) == (1, 1):
            continue
        if getattr(mod, FHWC_PARAM, None) is None:
            mod.register_parameter(FHWC_PARAM, _fhwc_parameter(mod.weight))
        count += 1
    return count


def _fhwc_parameter(weight: torch.nn.Parameter) -> torch.nn.Parameter:
    """weight channels-last; a placeholder of that shape when weight is one (the archive
    computes it from the model's files: `derived_weight_maker`)."""
    if is_placeholder(weight):
        o, c, kh, kw = weight.shape
        return mark(
            torch.nn.Parameter(placeholder((o, kh, kw, c), weight.dtype), requires_grad=False)
        )
    with torch.no_grad():
        return torch.nn.Parameter(
            weight.detach().permute(0, 2, 3, 1).contiguous(), requires_grad=False
        )


def derived_weight_maker(name: str, shape: tuple[int, ...], dtype: torch.dtype, source):
    """A function computing parameter name (`<conv>.weight_fhwc`) from the conv's weight as the
    model's files hold it, in dtype."""
    conv_weight = name[: -len(FHWC_PARAM)] + "weight"

    def make() -> torch.Tensor:
        w = source.tensor(conv_weight).to(dtype).permute(0, 2, 3, 1).contiguous()
        if tuple(w.shape) != tuple(shape):
            raise ValueError(f"{name}: {conv_weight} gives {tuple(w.shape)}, not {tuple(shape)}")
        return w

    return make
