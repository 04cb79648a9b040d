"""OpenVINO as a bench peer: the CPU plugin, with INFERENCE_PRECISION_HINT f32 or its default.

The default hint is bf16 where the CPU has avx512_bf16 or AMX and f32 elsewhere; the report
records the precision the compiled models actually use, with the plugin's performance hint
(LATENCY by default) and thread count. Other settings are OpenVINO's defaults.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .base import PeerSide


class OpenVinoSide(PeerSide):
    ENGINE = "openvino"
    FORMAT = "openvino"
    HINT: str | None = None  # INFERENCE_PRECISION_HINT; None: the plugin's default

    @staticmethod
    def imports() -> None:
        import openvino  # noqa: F401

    def load(self, folder: Path, submodule: str):
        import openvino as ov

        if not hasattr(self, "core"):
            self.core = ov.Core()
        config = {"INFERENCE_PRECISION_HINT": self.HINT} if self.HINT else {}
        compiled = self.core.compile_model(str(folder / f"{submodule}.xml"), "CPU", config)
        return compiled, compiled.create_infer_request()

    def run(self, model, args: list[np.ndarray]) -> list[np.ndarray]:
        compiled, request = model
        request.infer(args)
        # copies: the request's output tensors are overwritten by its next call
        return [request.get_output_tensor(i).data.copy() for i in range(len(compiled.outputs))]

    def engine_info(self) -> dict:
        compiled, _ = self.models["unet"]
        precision = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        return {
            "precision": precision,
            "precision_hint": self.HINT or "default",
            "performance_hint": str(compiled.get_property("PERFORMANCE_HINT")),
            "threads": int(compiled.get_property("INFERENCE_NUM_THREADS")),
            "cpu_capabilities": list(self.core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")),
        }


class OpenVinoF32Side(OpenVinoSide):
    HINT = "f32"


class OpenVinoDefaultSide(OpenVinoSide):
    HINT = None
