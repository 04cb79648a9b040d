"""The export stage of the compile's Builder (compile/driver.py): what a submodule's export
depends on (its keys, in the artifact's cache and in the export cache shared by every model of
an architecture), the torch side (each component's model with placeholder parameters, loaded
only when something must be exported, and dropped once no later submodule needs it), and the
export itself, one MLIR per submodule with its signature beside it. A mixin: Builder holds the
state it reads (plan, reporter, model hash, versions, the torch models)."""

from __future__ import annotations

import json
from pathlib import Path

from sdiree.runtime.fileutil import atomic_path, atomic_write_json, sha256_json

from .exporters import EXPORTER_REVISION, kernels_for

# Config entries that say where, by which version or in which dtype a model's files were
# written, not what it computes: the export casts the (placeholder) weights to its own dtype
CONFIG_METADATA = (
    "_name_or_path", "_diffusers_version", "transformers_version", "_commit_hash", "torch_dtype",
    "dtype",
)  # fmt: skip


class ExportStage:
    """Builder's export keys, torch models and exports (this file's docstring)."""

    def export_options(self, submodule: str) -> dict:
        return self.plan.target.export_for(submodule, self.plan.dtype, self.plan.arch)

    def export_key(self, submodule: str) -> str:
        return sha256_json({"model": self.model_hash, **self._export_inputs(submodule)})

    def _export_inputs(self, submodule: str) -> dict:
        """What submodule's export depends on besides the model."""
        p = self.plan
        return {
            "submodule": submodule,
            "dtype": p.export_dtype,
            "shape": [p.batch_size, p.height, p.width],
            # more sizes (`--sizes`): the UNet's and VAE's entry functions for them
            **(
                {"sizes": [list(hw) for hw in p.extra_sizes]}
                if p.extra_sizes and submodule != "text_encoder"
                else {}
            ),
            # the VAE is exported at its tile size where it tiles
            **({"vae_tile": p.vae_tile} if submodule.startswith("vae") and p.vae_tiled else {}),
            "export": self.export_options(submodule),
            **({"kernels": k} if (k := kernels_for(self.export_options(submodule))) else {}),
            "exporter_revision": EXPORTER_REVISION,
            "versions": self.versions,
        }

    def architecture_key(self, submodule: str, xplan) -> str:
        """The key of submodule's export in the export cache (compile/build_cache.py): the
        same for every model of this architecture, whose export is the same MLIR. The model
        enters by its configs (file metadata aside), its parameters' names, dtypes and shapes,
        and the values of whatever the export sees that is not a shape-only placeholder."""
        import hashlib

        import torch

        from .exporters import COMPONENTS
        from .placeholders import is_placeholder

        state = []
        for name, t in xplan.params_module.state_dict(keep_vars=True).items():
            value = None
            if not is_placeholder(t):
                raw = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()
                value = hashlib.sha256(raw.tobytes()).hexdigest()
            state.append([name, str(t.dtype), list(t.shape), value])
        # the configs the submodule's exporter reads: the UNet's reads the text encoders' too
        prefix = {"unet": ""}.get(COMPONENTS[submodule], COMPONENTS[submodule].removesuffix("_2"))
        configs = {
            c: {k: v for k, v in cfg.items() if k not in CONFIG_METADATA}
            for c, cfg in self.plan.configs.items()
            if c.startswith(prefix) and c not in ("scheduler", "tokenizer", "tokenizer_2")
        }
        return sha256_json(
            {
                "export_cache": 1,
                **self._export_inputs(submodule),
                "family": self.plan.family.name,
                "configs": configs,
                "state": state,
            }
        )

    def mlir_path(self, submodule: str) -> Path:
        return self.plan.shared / "mlir" / f"{submodule}-{self.export_key(submodule)[:16]}.mlirbc"

    def signature_path(self, submodule: str) -> Path:
        return self.mlir_path(submodule).with_suffix(".json")

    def export_signature(self, submodule: str) -> dict:
        """Entry functions of an exported submodule, saved beside its MLIR at export time."""
        return json.loads(self.signature_path(submodule).read_text())["functions"]

    def torch_model(self, component: str):
        """The component's model with placeholder parameters (compile/placeholders.py): the
        export needs only their shapes, and the archives read the weights from the model's
        files one at a time (`weight_source`), so no stage holds them all."""
        if component not in self._torch_models:
            from .placeholders import casts_stay_placeholders, replace_parameters
            from .weight_source import WeightSource

            with self.r.stage("load", component):
                import torch

                replaced = component == "vae" and self.plan.vae_file is not None
                # --vae's weights are loaded into the model: in float32, never rounded
                model = self.plan.model.load(component, torch.float32 if replaced else None)
                folder = self.plan.model.path / component
                if replaced:
                    _replace_vae(model, self.plan.vae_file)
                    folder = None  # the weights are --vae's, in memory
                self._sources[component] = WeightSource.capture(model, folder)
                replace_parameters(model)
                # float32, as the plan and export expect (they cast to the compile's dtype
                # themselves): loaded in its files' dtype, the casts make placeholders only
                with casts_stay_placeholders():
                    model.to(torch.float32)
                self._torch_models[component] = model
        return self._torch_models[component]

    def weight_source(self, component: str):
        self.torch_model(component)
        return self._sources[component]

    def export_plan(self, submodule: str):
        if submodule in self._plans:
            return self._plans[submodule]
        from .exporters import plan_for
        from .placeholders import casts_stay_placeholders

        with casts_stay_placeholders():
            self._plans[submodule] = plan_for(self, submodule)
        return self._plans[submodule]

    def release_torch(self, submodule: str, later: tuple[str, ...]) -> None:
        """Drop submodule's torch model once exported and saved, unless a later submodule
        shares it (the VAE): iree-compile and the encoder need the memory more."""
        import gc

        from .exporters import COMPONENTS

        self._plans.pop(submodule, None)
        component = COMPONENTS[submodule]
        if all(COMPONENTS[s] != component for s in later):
            self._torch_models.pop(component, None)
            self._sources.pop(component, None)
            gc.collect()

    def ensure_mlir(self, submodule: str) -> Path:
        path = self.mlir_path(submodule)
        if path.is_file() and self.signature_path(submodule).is_file():
            self.r.reused("export", submodule)
            return path
        from .exporters import kernel_isa
        from .exporters.amx_matmul import set_kernel_isa
        from .exporters.base import export_to_mlir

        path.parent.mkdir(parents=True, exist_ok=True)
        xplan = self.export_plan(submodule)
        parts = {"mlirbc": path, "json": self.signature_path(submodule)}
        key = self.architecture_key(submodule, xplan)
        if self.exports.fetch(key, parts) is not None:
            self.r.reused("export", submodule, "exported before for a model of this architecture")
            return path
        with self.r.stage("export", submodule):
            # the kernel objects its kernel ops link (export choice `kernel_isa`)
            set_kernel_isa(kernel_isa(self.export_options(submodule)))
            with atomic_path(path) as tmp:
                export_to_mlir(xplan, tmp)
            sidecar = {"functions": xplan.signature_json(), "derived": xplan.derived}
            atomic_write_json(self.signature_path(submodule), sidecar)
        self.exports.store(key, parts)
        return path


def _replace_vae(model, path: Path) -> None:
    """Load --vae's weights into the model's VAE, every tensor checked by key and shape."""
    import numpy as np
    import torch

    from sdiree.runtime.weights.sources import match_component, read_vae_file

    targets = {k: (tuple(v.shape), np.dtype(np.float32)) for k, v in model.state_dict().items()}
    given = match_component("vae", read_vae_file(path), targets, f"--vae {path}")
    model.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in given.items()})
