"""Peers in `sdiree bench`: OpenVINO and ONNX Runtime timed on the same calls as sdiree and torch.

Optional: the `peers` extra (openvino, onnxruntime, onnx). Each peer is one more bench side,
run in its own worker process and alternated call by call with sdiree and torch. Its models are
the model's own diffusers modules, exported to ONNX (and converted from that ONNX to OpenVINO
IR) once per model and shape by ``peers.export`` and cached in the user's sdiree cache
(``$SDIREE_CACHE/peers/``).

Peers, as named by ``sdiree bench --peers`` (comma-separated):

- ``onnxruntime``: ONNX Runtime, CPU execution provider, fp32 (all graph optimisations);
- ``openvino-f32``: OpenVINO CPU with ``INFERENCE_PRECISION_HINT`` f32;
- ``openvino-default``: OpenVINO CPU with its default precision hint: bf16 on CPUs with
  avx512_bf16 or AMX, f32 elsewhere (the report records which it chose);
- ``openvino``: both OpenVINO rows.

Nothing here imports a peer engine at import time: ``check_installed`` looks the modules up
without importing them, so a missing extra is one line saying how to install it.
"""

from __future__ import annotations

import importlib.util

from sdiree.runtime.errors import UserError

# name -> (engine module, class name, modules it needs at run time or to export its models)
PEERS = {
    "onnxruntime": ("onnxruntime", "OrtSide", ("onnxruntime", "onnx")),
    "openvino-f32": ("openvino", "OpenVinoF32Side", ("openvino", "onnx")),
    "openvino-default": ("openvino", "OpenVinoDefaultSide", ("openvino", "onnx")),
}
ALIASES = {"openvino": ("openvino-f32", "openvino-default"), "ort": ("onnxruntime",)}
PEERS_HINT = "pip install 'sdiree[peers]' (from a source checkout: pip install -e '.[peers]')"


def parse_peers(text: str | None) -> list[str]:
    """The peer names in a --peers value, aliases expanded, in the given order, each once."""
    if not text:
        return []
    names: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name not in PEERS and name not in ALIASES:
            choices = ", ".join([*PEERS, *ALIASES])
            raise UserError(f"--peers: unknown peer '{raw.strip()}'; choose from {choices}")
        for n in ALIASES.get(name, (name,)):
            if n not in names:
                names.append(n)
    return names


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_installed(peers: list[str]) -> None:
    """One UserError line naming what is missing and how to install it, or nothing."""
    missing = sorted({m for p in peers for m in PEERS[p][2] if not _found(m)})
    if missing:
        raise UserError(
            f"sdiree bench --peers {','.join(peers)} needs the peers extra (openvino, "
            f"onnxruntime, onnx), which is not installed (missing: {', '.join(missing)}): "
            f"{PEERS_HINT}"
        )


def needs_openvino(peers: list[str]) -> bool:
    return any(PEERS[p][0] == "openvino" for p in peers)


def side_class(name: str):
    """The bench Side class of a peer (imports its engine module only now)."""
    module, cls, _ = PEERS[name]
    mod = importlib.import_module(f"{__name__}.{module}")
    return getattr(mod, cls)
