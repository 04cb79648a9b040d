"""sdiree.runtime: the lean, torch-free side of sdiree.

Loads compiled IREE modules and their parameters and drives tokenizer, scheduler loop, guidance
and image output in numpy. Nothing under this package may import torch, diffusers, transformers,
iree.compiler or iree.turbine.
"""

__version__ = "0.1.0"
