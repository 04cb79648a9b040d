"""Parameters streamed from the model's files (compile/weight_source.py, archive_writer.py): the
exported MLIR and every archive are byte for byte those of the fully loaded model, while the
model handed to the export holds placeholders (compile/placeholders.py), never its weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.archive_writer import ArchiveEntry, write_archive  # noqa: E402
from sdiree.compile.exporters.base import export_to_mlir, save_parameters  # noqa: E402
from sdiree.compile.placeholders import (  # noqa: E402
    casts_stay_placeholders,
    is_placeholder,
    replace_parameters,
)
from sdiree.compile.weight_source import FileTensor, WeightSource  # noqa: E402


def _streamed(load, folder, plan):
    """plan run on a placeholder model as the compile driver does: (export plan, source)."""
    model = load()
    source = WeightSource.capture(model, folder)
    replace_parameters(model)
    with casts_stay_placeholders():
        return plan(model), source


def _archives(xplan, tmp_path, tag, source=None) -> list[bytes]:
    out = []
    for derived in (False, True) if xplan.derived else (False,):
        path = tmp_path / f"{tag}-{derived}.irpa"
        save_parameters(xplan.params_module, path, derived=derived, source=source)
        out.append(path.read_bytes())
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unet_archives_equal_the_loaded_models(tiny_model, tmp_path, dtype):
    """Winograd weights (F(2x2) and, per conv, F(4x4)) computed per tensor when written, and the
    fp16 cast done per tensor, give the archives of the loaded model."""
    from diffusers import UNet2DConditionModel

    from sdiree.compile.exporters.unet import plan_unet

    def load():
        return UNet2DConditionModel.from_pretrained(tiny_model / "unet")

    def plan(model):
        return plan_unet(
            model, batch=1, latent_hws=[(8, 8)], text_len=77,
            text_dim=model.config.cross_attention_dim, dtype=dtype, attention="sdpa",
            conv="winograd", winograd4_min_side=8,
        )  # fmt: skip

    loaded = plan(load())
    streamed, source = _streamed(load, tiny_model / "unet", plan)
    assert source.from_files() == len(source.tensors)  # every weight read from the file
    assert loaded.derived == streamed.derived and "+" in streamed.derived  # both tile sizes
    params = list(streamed.params_module.parameters())
    assert params and all(is_placeholder(p) and p.dtype == dtype for p in params)
    assert _archives(streamed, tmp_path, "streamed", source) == _archives(loaded, tmp_path, "ref")


def test_text_encoder_export_and_archive_equal_the_loaded_models(tiny_model, tmp_path):
    """The export sees only placeholders yet writes the same MLIR; transformers 5's CLIP state
    dict (no `text_model.` prefix) is matched to the file's keys."""
    from transformers import CLIPTextModel

    from sdiree.compile.exporters.text_encoder import plan_text_encoder

    def load():
        return CLIPTextModel.from_pretrained(tiny_model / "text_encoder")

    def plan(model):
        return plan_text_encoder(
            model, submodule="text_encoder", batch=1, max_length=77, dtype=torch.float32,
            attention="sdpa",
        )  # fmt: skip

    loaded = plan(load())
    streamed, source = _streamed(load, tiny_model / "text_encoder", plan)
    assert source.from_files() == len(source.tensors)
    export_to_mlir(loaded, tmp_path / "ref.mlirbc")
    export_to_mlir(streamed, tmp_path / "streamed.mlirbc")
    assert (tmp_path / "ref.mlirbc").read_bytes() == (tmp_path / "streamed.mlirbc").read_bytes()
    assert _archives(streamed, tmp_path, "streamed", source) == _archives(loaded, tmp_path, "ref")


def test_weights_changed_after_loading_are_kept_not_read_from_the_file(tiny_model):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(tiny_model / "vae")
    with torch.no_grad():
        vae.decoder.conv_out.weight.view(-1)[-1] += 1.0
    source = WeightSource.capture(vae, tiny_model / "vae")
    kept = source.tensors["decoder.conv_out.weight"]
    assert not isinstance(kept, FileTensor)
    assert torch.equal(kept, vae.decoder.conv_out.weight.detach())
    assert isinstance(source.tensors["decoder.conv_in.weight"], FileTensor)
    assert WeightSource.capture(vae, None).from_files() == 0


def test_a_placeholder_without_a_source_is_refused(tmp_path):
    model = torch.nn.Linear(3, 2)
    replace_parameters(model)
    with pytest.raises(ValueError, match="placeholder"):
        save_parameters(model, tmp_path / "x.irpa")


def test_casts_of_placeholders_make_placeholders():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    replace_parameters(model)
    with casts_stay_placeholders():
        model.to(torch.float16)
    assert all(is_placeholder(p) and p.dtype == torch.float16 for p in model.parameters())
    model.to(torch.float32)  # outside the block: an ordinary cast, the result no placeholder
    assert not any(is_placeholder(p.data) for p in model.parameters())


def test_streamed_archive_equals_turbines(tmp_path):
    """write_archive from file ranges and made tensors == ParameterArchiveBuilder's archive."""
    from iree.turbine.aot import ParameterArchiveBuilder
    from safetensors.torch import save_file

    from sdiree.compile.weight_source import read_header

    g = torch.Generator().manual_seed(0)
    tensors = {
        "a": torch.randn(5, 7, generator=g),
        "b": torch.randn(3, generator=g).half(),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.tensor(2.5),
        "e": torch.randn(4, 4, generator=g).t(),  # not contiguous
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "w.safetensors")
    in_file = read_header(tmp_path / "w.safetensors")
    builder = ParameterArchiveBuilder()
    entries = []
    for name, t in tensors.items():
        builder.add_tensor(name, t)
        source = in_file[name] if name in "ac" else (lambda t=t: t)
        entries.append(ArchiveEntry(name, t.dtype, tuple(t.shape), source))
    builder.add_tensor("f", tensors["a"].half())
    entries.append(ArchiveEntry("f", torch.float16, (5, 7), lambda: in_file["a"].read().half()))
    builder.save(tmp_path / "ref.irpa")
    assert write_archive(entries, tmp_path / "streamed.irpa") == len(entries)
    assert (tmp_path / "streamed.irpa").read_bytes() == (tmp_path / "ref.irpa").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["w.safetensors", "ref.irpa", "streamed.irpa"]
    )  # the scratch file is gone


def test_the_driver_exports_and_writes_from_placeholders(tiny_model, tmp_path, monkeypatch):
    """`sdiree compile` hands the export a model of placeholders, and its archives come from the
    model's files (no weight of the model in memory): the mechanism behind its memory use."""
    import io

    import sdiree.compile.exporters.base as base
    from sdiree.compile.driver import Builder, CompileOptions, resolve
    from sdiree.compile.report import Reporter

    seen = {}
    real_export, real_save = base.export_to_mlir, base.save_parameters

    def export(xplan, path, strict=False):
        seen["export"] = [is_placeholder(p) for p in xplan.params_module.parameters()]
        return real_export(xplan, path, strict)

    def save(module, path, derived=False, source=None):
        seen.setdefault("sources", []).append(source.from_files() == len(source.tensors))
        return real_save(module, path, derived, source)

    monkeypatch.setattr(base, "export_to_mlir", export)
    monkeypatch.setattr(base, "save_parameters", save)
    monkeypatch.setenv("SDIREE_CACHE", str(tmp_path / "cache"))
    r = Reporter(stream=io.StringIO())
    b = Builder(resolve(CompileOptions(tiny_model, "cpu", out=tmp_path / "out"), r), r)
    b.plan.shared.mkdir(parents=True)
    b.model_hash = "0" * 64
    b.ensure_mlir("text_encoder")
    b.ensure_params("text_encoder")
    assert seen["export"] and all(seen["export"])
    assert seen["sources"] == [True]


def _fp16_copy(model: Path, out: Path) -> Path:
    """model's folder with every component's weights saved in fp16 (as fp16 releases ship)."""
    import shutil

    from sdiree.compile.model_source import open_model

    shutil.copytree(model, out)
    source = open_model(model)
    for component in ("text_encoder", "unet", "vae"):
        for f in (out / component).glob("*.safetensors"):
            f.unlink()
        source.load(component, torch.float32).half().save_pretrained(out / component)
    return out


def test_an_fp16_folder_loads_without_copies_and_compiles_for_fp32(tiny_model, tmp_path):
    """An fp16 folder loads in fp16 (the loader maps the files: SDXL's UNet 0.5 GB, not 15 GB
    cast to fp32), the plan and export still see an fp32 model of placeholders, and the fp32
    archive holds the fp16 values exactly."""
    import io

    from sdiree.compile.driver import Builder, CompileOptions, resolve
    from sdiree.compile.model_source import files_dtype
    from sdiree.compile.report import Reporter
    from sdiree.runtime.weights.archive import Archive

    half = _fp16_copy(tiny_model, tmp_path / "tiny-fp16")
    assert files_dtype(half / "unet") == torch.float16
    assert files_dtype(tiny_model / "unet") == torch.float32
    r = Reporter(stream=io.StringIO())
    b = Builder(resolve(CompileOptions(half, "cpu", out=tmp_path / "out"), r), r)
    b.plan.shared.mkdir(parents=True)
    b.model_hash = "0" * 64
    unet = b.torch_model("unet")
    assert all(is_placeholder(p) and p.dtype == torch.float32 for p in unet.parameters())
    source = b.weight_source("unet")
    assert source.from_files() == len(source.tensors)
    assert set(source.dtypes.values()) == {torch.float16}
    b.ensure_mlir("unet")  # its plan runs the UNet once (the conv sides) on fp32 inputs
    (archive, _), *_ = b.ensure_params("unet")
    got = Archive(archive).array("conv_in.weight")
    file_value = source.tensor("conv_in.weight").float().numpy()
    assert got.dtype == np.float32 and np.array_equal(got, file_value)
