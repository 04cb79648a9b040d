"""What every peer side shares: the bench's figures on an engine's three models.

A peer side is a bench Side (``imports``, ``__init__(spec)``, ``figures``, ``info``,
``after_run``) whose engine runs the exported text encoders (SDXL: both), guided UNet and VAE
decoder, on the bench's calls and inputs as sdiree's side makes them. It also
serves as the Session of sdiree's own numpy pipeline (``call(submodule, function, *args)``), so
its whole-image figure is sdiree's Text2Image (tokenizer, scheduler, guidance) with the engine's
models: the same steps as sdiree's image, only the three models differ. Like sdiree's side,
every call takes numpy inputs and returns numpy outputs on the host.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..bench_family import bench_calls


class PeerSide:
    ENGINE = ""  # distribution name, for its version
    FORMAT = ""  # the models' folder: "onnx" or "openvino"

    def __init__(self, spec: dict):
        from sdiree.compile.bench import image_request
        from sdiree.runtime.image_output import to_uint8
        from sdiree.runtime.manifest import load_manifest
        from sdiree.runtime.pipeline import Text2Image

        folder = Path(spec["peer_models"]) / self.FORMAT
        manifest = load_manifest(Path(spec["artifact_dir"]))
        self.calls = bench_calls(manifest)  # the bench's own calls
        self.models = {sub: self.load(folder, sub) for sub, _ in self.calls}
        t2i = Text2Image(manifest, self)
        req = image_request(manifest, spec)
        x = dict(np.load(spec["inputs"]))
        calls = {sub: (fn, [x[name] for name in names]) for (sub, fn), names in self.calls.items()}
        encoders = [sub for sub, (fn, _) in calls.items() if fn == "encode"]

        def call(sub: str) -> list[np.ndarray]:
            fn, args = calls[sub]
            return self.call(sub, fn, *args)

        self.figures = {
            "text_encoder": lambda: [o for sub in encoders for o in call(sub)],
            "unet": lambda: call("unet"),
            "vae_decode": lambda: call("vae_decoder"),
            "image": lambda: [to_uint8(t2i.generate(req, progress=None).images)],
        }
        self.info = {
            "engine": self.ENGINE,
            "version": self.version(),
            "format": self.FORMAT,
            "models": str(folder),
            **self.engine_info(),
        }

    def call(self, submodule: str, function: str, *args: np.ndarray) -> list[np.ndarray]:
        """sdiree's Session.call contract: host arrays in, host arrays out (float32 here)."""
        if (submodule, function) not in self.calls:
            raise ValueError(
                f"the peers' models have no {submodule}.{function}: they time guided calls only "
                f"(guidance scale above 1)"
            )
        args = [a.astype(np.float32) if a.dtype.kind == "f" else a for a in args]
        return self.run(self.models[submodule], args)

    def after_run(self) -> dict:
        return {}

    def version(self) -> str | None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(self.ENGINE)
        except PackageNotFoundError:
            return None

    # -- per engine --

    def load(self, folder: Path, submodule: str):
        raise NotImplementedError

    def run(self, model, args: list[np.ndarray]) -> list[np.ndarray]:
        raise NotImplementedError

    def engine_info(self) -> dict:
        return {}
