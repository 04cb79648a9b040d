"""sdiree.compile: the heavy side of sdiree.

Loads a diffusers Stable Diffusion model, exports each submodule with iree-turbine to MLIR with
externalized parameters, and compiles it with iree-compile for a target from specs/. Needs the
`compile` extra (torch, iree-turbine, iree-base-compiler, diffusers, transformers).
"""
