"""LoRA at load time, torch-free: parse LoRA files, merge them into the weights in numpy.

`plan_loras` reads one or more LoRA files (kohya/LyCORIS, diffusers/PEFT) against the
parameter keys of a compiled artifact and returns a `LoraPlan`: which weights change, what
could not be matched (for the caller to print), and `merged(component, key, base)` to compute
one merged weight at a time. `prompt_syntax` handles A1111's ``<lora:name:0.8>`` prompt tags
and `hashes` the short hashes A1111 writes as ``Lora hashes``.
"""

from .hashes import addnet_hash, lora_hashes_value, lora_short_hash
from .plan import LoraPlan, LoraReport, LoraSpec, plan_loras
from .prompt_syntax import PromptLora, extract_prompt_loras, resolve_lora_name

__all__ = [
    "LoraPlan",
    "LoraReport",
    "LoraSpec",
    "PromptLora",
    "addnet_hash",
    "extract_prompt_loras",
    "lora_hashes_value",
    "lora_short_hash",
    "plan_loras",
    "resolve_lora_name",
]
