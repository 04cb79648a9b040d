"""Weights other than the ones an artifact was compiled with, loaded without recompiling.

An artifact's modules read their weights by name from parameter archives, so another set of
tensors of the same architecture (a fine-tune's checkpoint, a VAE, LoRA-merged weights) can be
loaded in their place: `archive` reads what an archive holds, `overrides` builds the parameter
providers with replaced tensors (and recomputes what compile derived or encoded from them),
`encoder` runs a kept parameter-encoder module where the target precomputes packed weights, and
`sources` turns the user's files into replaced tensors.
"""
