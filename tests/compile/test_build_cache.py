"""The build cache (compile/build_cache.py): a second model of an architecture reuses the
exports and modules of the first, its parameters are its own and encoded from its own weights,
and its images are its own; a damaged or partial entry is built again, never used; what the
export sees besides shapes keys it."""

from __future__ import annotations

import io
import os

import pytest

from sdiree.compile.build_cache import BuildCache
from sdiree.compile.driver import CompileOptions, compile_model
from sdiree.compile.report import Reporter

KEY = "ab" * 32


def _files(tmp_path, encoder=True) -> dict:
    (tmp_path / "src").mkdir(exist_ok=True)
    parts = {"vmfb": tmp_path / "src" / "m.vmfb"}
    parts["vmfb"].write_bytes(b"module bytes")
    if encoder:
        parts["encoder"] = tmp_path / "src" / "e.vmfb"
        parts["encoder"].write_bytes(b"encoder bytes")
    return parts


def _dests(tmp_path, tag="a") -> dict:
    return {"vmfb": tmp_path / f"{tag}.vmfb", "encoder": tmp_path / f"{tag}.enc"}


def test_store_then_fetch_links_the_same_bytes(tmp_path):
    cache = BuildCache(tmp_path / "root", "modules")
    parts = _files(tmp_path)
    assert cache.fetch(KEY, _dests(tmp_path)) is None
    cache.store(KEY, parts)
    assert cache.fetch(KEY, _dests(tmp_path)) == {"vmfb", "encoder"}
    assert (tmp_path / "a.vmfb").read_bytes() == b"module bytes"
    assert (tmp_path / "a.enc").read_bytes() == b"encoder bytes"
    assert os.path.samefile(tmp_path / "a.vmfb", parts["vmfb"])  # a hardlink: no extra disk
    assert cache.fetch("cd" * 32, _dests(tmp_path, "b")) is None  # another key, another entry
    # an entry with a part the caller has no place for is not used
    assert cache.fetch(KEY, {"vmfb": tmp_path / "c.vmfb"}) is None
    assert BuildCache(tmp_path / "root", "exports").fetch(KEY, _dests(tmp_path, "d")) is None


def test_an_entry_without_a_part_says_so(tmp_path):
    cache = BuildCache(tmp_path / "root", "modules")
    cache.store(KEY, _files(tmp_path, encoder=False))
    assert cache.fetch(KEY, _dests(tmp_path)) == {"vmfb"}
    assert not (tmp_path / "a.enc").exists()


@pytest.mark.parametrize("damage", ["module", "encoder", "record", "no record"])
def test_a_damaged_or_partial_entry_is_a_miss_and_is_removed(tmp_path, damage):
    cache = BuildCache(tmp_path / "root", "modules")
    parts = _files(tmp_path)
    cache.store(KEY, parts)
    stem = KEY[:32]
    target = (
        cache.dir
        / {
            "module": f"{stem}.vmfb",
            "encoder": f"{stem}.encoder",
            "record": f"{stem}.record.json",
            "no record": f"{stem}.record.json",
        }[damage]
    )
    target.unlink()  # (a hardlink of the source: replaced, not written through)
    if damage == "record":
        target.write_text("{not json")
    elif damage != "no record":
        target.write_bytes(b"other bytes of a killed or changed write")
    assert cache.fetch(KEY, _dests(tmp_path)) is None
    assert not (tmp_path / "a.vmfb").exists()
    if damage in ("module", "encoder"):  # the entry is gone: the next build stores it anew
        assert not (cache.dir / f"{stem}.record.json").exists()
    cache.store(KEY, parts)
    assert cache.fetch(KEY, _dests(tmp_path)) == {"vmfb", "encoder"}


def test_an_unwritable_cache_costs_only_a_build(tmp_path):
    (tmp_path / "root").write_text("a file where the cache folder would be")
    cache = BuildCache(tmp_path / "root", "modules")
    cache.store(KEY, _files(tmp_path))  # no error
    assert cache.fetch(KEY, _dests(tmp_path)) is None


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """The tiny SD 1.x architecture with other weights (another seed)."""
    from make_tiny_sd import make_tiny_sd

    return make_tiny_sd(tmp_path_factory.mktemp("other") / "tiny-other", seed=1)


@pytest.mark.parametrize(
    "target,arch,steps", [("cpu", "host", 8), ("vulkan-spirv", "lavapipe", 4)],
    ids=["cpu", "lavapipe"],
)  # fmt: skip
def test_another_model_of_the_architecture_reuses_exports_and_modules(
    compiled, other_model, tmp_path, target, arch, steps
):
    from parity import diffusers_images, psnr, sdiree_images

    base = compiled.get(target, arch, "fp32")
    out = tmp_path / "other"
    rep = Reporter(stream=io.StringIO())
    compile_model(
        CompileOptions(model_dir=other_model, target=target, arch=arch, dtype="fp32", out=out),
        rep,
    )
    status = {(r.stage, r.item): r.status for r in rep.records}
    subs = ("text_encoder", "unet", "vae_decoder", "vae_encoder")
    assert all(status[("export", s)] == "reused" for s in subs), status
    assert all(status[("compile", s)] == "reused" for s in subs), status
    log = rep.stream.getvalue()
    assert "exported before for a model of this architecture" in log
    assert "compiled before for the same MLIR" in log
    for s in subs:
        assert (out / f"{s}.vmfb").read_bytes() == (base / f"{s}.vmfb").read_bytes()
    # each encoder ran on this model's weights, not the first model's (cpu encodes every
    # submodule's; lavapipe only the text encoder's, its UNet and VAE need none)
    encoded = [s for s in subs if (base / f"{s}.encoded.irpa").is_file()]
    assert "unet" in encoded or target != "cpu"
    for s in encoded:
        assert status[("encode", s)] == "done"
        assert (out / f"{s}.encoded.irpa").read_bytes() != (base / f"{s}.encoded.irpa").read_bytes()
    prompt = "a lighthouse on a cliff"
    ours, _ = sdiree_images(out, "euler", steps, 7.5, 42, prompt, "", 1)
    ref = diffusers_images(other_model, "euler", steps, 7.5, 42, prompt, "", 1, (64, 64))
    assert psnr(ours, ref) >= 40.0
    first, _ = sdiree_images(base, "euler", steps, 7.5, 42, prompt, "", 1)
    assert psnr(first, ref) < 30.0  # the first model's image is not the second's


def test_compiles_with_and_without_out_share_the_user_cache(
    tiny_model, other_model, tmp_path, monkeypatch
):
    """The build cache is the user cache's for every compile, whatever --out is: a compile into
    an artifacts root (no --out) stores its export and module there, and a compile of another
    model of the architecture with --out into another root reuses both (hardlinked out). Only
    the text encoder, from an empty user cache: cheap, and no other test's entry helps."""
    cache = tmp_path / "user-cache"
    monkeypatch.setenv("SDIREE_CACHE", str(cache))

    def build(model, **where):
        rep = Reporter(stream=io.StringIO())
        opts = CompileOptions(model, "cpu", arch="host", dtype="fp32", **where)
        opts.submodules = ("text_encoder",)
        manifest = compile_model(opts, rep)
        status = {(r.stage, r.item): r.status for r in rep.records}
        return manifest.parent, status, rep.stream.getvalue()

    root_a = tmp_path / "root-a"
    first, status, _ = build(tiny_model, artifacts_root=root_a)
    assert first.parent == root_a.absolute() / tiny_model.name  # the default --out
    assert status[("export", "text_encoder")] == status[("compile", "text_encoder")] == "done"
    assert not (root_a / ".exports").exists() and not (root_a / ".modules").exists()
    (module,) = (cache / ".modules").glob("*.vmfb")
    assert list((cache / ".exports").glob("*.mlirbc"))
    assert os.path.samefile(first / "text_encoder.vmfb", module)

    second, status, log = build(other_model, out=tmp_path / "root-b" / "art")
    assert status[("export", "text_encoder")] == status[("compile", "text_encoder")] == "reused"
    assert "exported before for a model of this architecture" in log
    assert "compiled before for the same MLIR" in log
    assert os.path.samefile(second / "text_encoder.vmfb", module)  # linked out, no extra disk
    assert [p.name for p in (cache / ".modules").glob("*.vmfb")] == [module.name]


def _builder(model, tmp_path):
    from sdiree.compile.driver import Builder, resolve

    r = Reporter(stream=io.StringIO())
    return Builder(resolve(CompileOptions(model, "cpu", out=tmp_path / model.name), r), r)


def test_the_export_key_is_the_architecture(tiny_model, other_model, tmp_path):
    import torch

    first, second = _builder(tiny_model, tmp_path), _builder(other_model, tmp_path)
    key = first.architecture_key("text_encoder", first.export_plan("text_encoder"))
    # another model of the architecture (other weights), and one whose config says where it
    # was written from and in which dtype: the same key
    assert key == second.architecture_key("text_encoder", second.export_plan("text_encoder"))
    second.plan.configs["text_encoder"]["_name_or_path"] = "/somewhere/else"
    second.plan.configs["text_encoder"]["torch_dtype"] = "float16"
    assert key == second.architecture_key("text_encoder", second.export_plan("text_encoder"))
    # a config entry of the component: another architecture; of another component: the same
    # (the UNet's exporter reads the text encoder's config too)
    unet = second.architecture_key("unet", second.export_plan("unet"))
    second.plan.configs["unet"]["norm_eps"] = 1e-6
    assert key == second.architecture_key("text_encoder", second.export_plan("text_encoder"))
    assert unet != second.architecture_key("unet", second.export_plan("unet"))
    second.plan.configs["text_encoder"]["layer_norm_eps"] = 1e-3
    assert key != second.architecture_key("text_encoder", second.export_plan("text_encoder"))
    assert unet != key  # another submodule
    # a tensor the export sees by value (a buffer, not a placeholder) keys it by its value
    xplan = first.export_plan("text_encoder")
    xplan.params_module.register_buffer("scale", torch.ones(3))
    with_buffer = first.architecture_key("text_encoder", xplan)
    assert with_buffer != key
    xplan.params_module.scale[1] = 2.0
    assert first.architecture_key("text_encoder", xplan) != with_buffer
