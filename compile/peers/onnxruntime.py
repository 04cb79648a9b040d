"""ONNX Runtime as a bench peer: the CPU execution provider in fp32, every graph optimisation on.

Threads are ONNX Runtime's default (intra-op: one per physical core), as a user gets them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .base import PeerSide


class OrtSide(PeerSide):
    ENGINE = "onnxruntime"
    FORMAT = "onnx"

    @staticmethod
    def imports() -> None:
        import onnxruntime  # noqa: F401

    def load(self, folder: Path, submodule: str):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 3  # errors only
        session = ort.InferenceSession(
            str(folder / f"{submodule}.onnx"), so, providers=["CPUExecutionProvider"]
        )
        return session, [i.name for i in session.get_inputs()]

    def run(self, model, args: list[np.ndarray]) -> list[np.ndarray]:
        session, names = model
        return session.run(None, dict(zip(names, args, strict=True)))

    def engine_info(self) -> dict:
        session, _ = self.models["unet"]
        return {
            "precision": "fp32",
            "provider": session.get_providers()[0],
            "graph_optimization": "ORT_ENABLE_ALL",
            "intra_op_threads": "default (physical cores)",
        }
