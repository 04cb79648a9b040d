"""The peers' models: the model's diffusers modules exported to ONNX, and that ONNX to OpenVINO IR.

The same entry modules sdiree exports and the bench's torch side calls (TextEncoderEntry with
its family's hidden states, the guided UNetEntry, VaeDecodeEntry with the scaling factor), one per
call the bench makes (``bench_family.bench_calls``: SD 1.x/2.x's one text encoder, SDXL's two
and its UNet's added ``text_embeds`` and ``time_ids``), in fp32 with SDPA attention, traced at the
artifact's static shapes by torch's TorchScript ONNX exporter at opset 17 (``dynamo=False``: the
torch.export one needs onnxscript, which the extra does not bring). Each ONNX file keeps its
weights in one external data file beside it (``<name>.onnx.data``), as a UNet's are over
protobuf's 2 GB. OpenVINO's IR is converted from that ONNX, weights kept in f32
(``compress_to_fp16=False``), so both peers run one graph.

Cached in the user's sdiree cache, ``$SDIREE_CACHE/peers/<model hash>-<H>x<W>-b<B>-<shapes
digest>-r<revision>/``, one folder per format (``onnx/``, ``openvino/``), each built under a
temporary name and renamed into place whole: a killed export leaves only its temporary folder,
removed by the next bench once its process is gone. The export runs in its own process
(``python -m sdiree.compile.peers.export SPEC``), so the bench parent never holds the model.
"""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from sdiree.runtime.fileutil import pid_alive

from ..bench_family import bench_calls

REVISION = 2  # bump when the exported graphs change: a new cache folder
OPSET = 17
FORMATS = {"onnx": (".onnx",), "openvino": (".xml", ".bin")}
_TMP_DIR = re.compile(r"^\.(\w+)\.(\d+)\.tmp$")


def submodules(calls: dict) -> list[str]:
    return [sub for sub, _ in calls]


def input_names(names: tuple[str, ...]) -> list[str]:
    return [a.split(".", 1)[1] for a in names]


def models_dir(manifest) -> Path:
    """Where the peers' models of this artifact's model and shapes are cached: the user's
    sdiree cache (`$SDIREE_CACHE/peers/`), never beside the artifact, which compile keeps
    self-contained and writes nothing around."""
    from sdiree.runtime.fileutil import sha256_json, user_cache_dir

    img = manifest.image
    shapes = {
        f"{sub}.{fn}": [list(t.shape) for t in manifest.submodules[sub].functions[fn].inputs]
        for sub, fn in bench_calls(manifest)
    }
    key = sha256_json(shapes)[:8]
    model_hash = manifest.data["model"]["content_hash"][:16]
    name = f"{model_hash}-{img['height']}x{img['width']}-b{img['batch_size']}-{key}-r{REVISION}"
    return user_cache_dir() / "peers" / name


def complete(folder: Path, fmt: str, subs: list[str]) -> bool:
    return all(
        (folder / fmt / f"{sub}{suffix}").is_file() for sub in subs for suffix in FORMATS[fmt]
    )


def ensure_models(
    manifest, model_dir: Path, inputs: Path, formats: list[str], work: Path, log=None
) -> Path:
    """The cached models folder with every format in formats, exported first where missing."""
    from sdiree.runtime.errors import UserError

    folder = models_dir(manifest)
    subs = submodules(bench_calls(manifest))
    remove_stale_dirs(folder)
    missing = [f for f in formats if not complete(folder, f, subs)]
    if not missing:
        return folder
    if log:
        print(
            f"[bench peers] exporting {', '.join(missing)} models to {folder} ...",
            file=log,
            flush=True,
        )
    spec = {
        "artifact_dir": str(manifest.root),
        "model_dir": str(model_dir),
        "inputs": str(inputs),
        "dir": str(folder),
        "formats": missing,
    }
    spec_path = work / "peers-export.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / "peers-export.log"
    with open(log_path, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "sdiree.compile.peers.export", str(spec_path)],
            stdin=subprocess.DEVNULL,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode != 0 or any(not complete(folder, f, subs) for f in missing):
        raise UserError(_failed(proc.returncode, log_path))
    return folder


def _failed(code: int, log_path: Path) -> str:
    """One line on a failed export: the signal that killed it (its log's last line is then
    whatever it printed before, often a tracer warning), else its log's last line."""
    import signal

    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        why = (
            " (out of memory? the kernel's OOM killer sends SIGKILL, see `dmesg`: the export "
            "holds the fp32 model and its traced copy; run the peers where memory allows, or "
            "without --peers)"
            if -code == signal.SIGKILL
            else ""
        )
        return f"exporting the peers' models was killed by {name}{why} (log: {log_path})"
    lines = [ln for ln in log_path.read_text(errors="replace").splitlines() if ln.strip()]
    tail = lines[-1].strip() if lines else "no output"
    return f"exporting the peers' models failed (exit {code}): {tail} (log: {log_path})"


# -- the export process ---------------------------------------------------------------------------


def remove_stale_dirs(folder: Path) -> None:
    """Temporary folders of exports whose process is gone (killed mid-export)."""
    if not folder.is_dir():
        return
    for p in folder.iterdir():
        m = _TMP_DIR.match(p.name)
        if m and p.is_dir() and (int(m.group(2)) == os.getpid() or not pid_alive(int(m.group(2)))):
            shutil.rmtree(p, ignore_errors=True)


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder into place (another export may have won the race)."""
    try:
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
        shutil.rmtree(tmp, ignore_errors=True)


def _entry(src, sub: str, encoders: dict[str, dict]):
    """The fp32 entry module of a submodule, attention as the bench's torch side sets it; a
    text encoder's component and hidden states as its family's recipe names them."""
    from diffusers.models.attention_processor import AttnProcessor2_0

    from ..exporters.text_encoder import TextEncoderEntry
    from ..exporters.unet import UNetEntry
    from ..exporters.vae import VaeDecodeEntry

    if sub in encoders:
        m = src.load(encoders[sub]["component"]).float().eval()
        m.set_attn_implementation("sdpa")
        return TextEncoderEntry(m, encoders[sub]["hidden_states"])
    if sub == "unet":
        m = src.load("unet").float().eval()
        m.set_attn_processor(AttnProcessor2_0())
        return UNetEntry(m)
    m = src.load("vae").float().eval()
    m.set_attn_processor(AttnProcessor2_0())
    return VaeDecodeEntry(m, m.config.scaling_factor)


def export_onnx(model_dir: Path, manifest, inputs: dict, out: Path) -> None:
    import onnx
    import torch

    from ..bench_family import family_spec
    from ..model_source import open_model

    src = open_model(model_dir)
    encoders = {te["submodule"]: te for te in family_spec(manifest)["text_encoders"]}
    raw = out / "raw"
    for (sub, fn), names in bench_calls(manifest).items():
        entry = _entry(src, sub, encoders)
        args = []
        for name in names:
            a = inputs[name]
            args.append(torch.from_numpy(a.astype(np.float32) if a.dtype.kind == "f" else a))
        outputs = len(manifest.submodules[sub].functions[fn].outputs)
        raw.mkdir(parents=True, exist_ok=True)
        # without grad: traced with it, every activation is kept for a backward pass (SDXL's
        # UNet at 1024² was killed at 24 GB; without, it peaks at 20.6 GB RSS, its mapped
        # weight files counted)
        with torch.no_grad():
            torch.onnx.export(
                entry,
                tuple(args),
                str(raw / f"{sub}.onnx"),
                dynamo=False,
                opset_version=OPSET,
                input_names=input_names(names),
                output_names=[f"output_{i}" for i in range(outputs)],
                do_constant_folding=True,
            )
        del entry  # freed before the ONNX weights are loaded: one copy at a time
        gc.collect()
        # One layout whatever the size: the graph, and its weights in one file beside it.
        model = onnx.load(str(raw / f"{sub}.onnx"), load_external_data=True)
        onnx.save_model(
            model,
            str(out / f"{sub}.onnx"),
            save_as_external_data=True,
            all_tensors_to_one_file=True,
            location=f"{sub}.onnx.data",
            size_threshold=1024,
        )
        del model
        shutil.rmtree(raw)
        print(f"exported {sub}.onnx", flush=True)


def convert_openvino(onnx_dir: Path, subs: list[str], out: Path) -> None:
    import openvino as ov

    out.mkdir(parents=True, exist_ok=True)
    for sub in subs:
        model = ov.convert_model(str(onnx_dir / f"{sub}.onnx"))
        ov.save_model(model, str(out / f"{sub}.xml"), compress_to_fp16=False)
        del model
        print(f"converted {sub}.xml", flush=True)


def main(spec_path: Path) -> int:
    from ..bench import _die_with_parent
    from ..quiet import quiet_libraries

    _die_with_parent()
    quiet_libraries()
    spec = json.loads(Path(spec_path).read_text())
    folder = Path(spec["dir"])
    folder.mkdir(parents=True, exist_ok=True)
    remove_stale_dirs(folder)
    from sdiree.runtime.manifest import load_manifest

    manifest = load_manifest(Path(spec["artifact_dir"]))
    subs = submodules(bench_calls(manifest))
    inputs = dict(np.load(spec["inputs"]))
    for fmt in ("onnx", "openvino"):  # OpenVINO's IR is converted from the ONNX
        if fmt not in spec["formats"] and not (fmt == "onnx" and "openvino" in spec["formats"]):
            continue
        if complete(folder, fmt, subs):
            continue
        tmp = folder / f".{fmt}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            if fmt == "onnx":
                tmp.mkdir()
                export_onnx(Path(spec["model_dir"]), manifest, inputs, tmp)
            else:
                convert_openvino(folder / "onnx", subs, tmp)
            _publish(tmp, folder / fmt)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(Path(sys.argv[1])))
