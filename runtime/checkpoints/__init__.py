"""Checkpoint files users bring, read torch-free: safetensors and torch zip files (pickles read
without running their code), the single-file LDM/SGM layout renamed to diffusers', and detection of
the model family a file holds.

    read_tensors(path) -> TensorFile     (read.py: .tensors, .metadata, .extras, .sha256())
    convert(tensors)   -> Converted      (ldm_layout.py: {"unet", "vae", "text_encoder"}, and
                                          SDXL's "text_encoder_2")
    detect(tensors)    -> Detected       (detect.py: family, inpainting, prediction type)
"""

from .detect import Detected, check_shapes, detect
from .ldm_layout import Converted, convert
from .read import TensorFile, read_tensors

__all__ = [
    "Converted",
    "Detected",
    "TensorFile",
    "check_shapes",
    "convert",
    "detect",
    "read_tensors",
]
