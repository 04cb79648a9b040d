"""The suite's background compile queue (tests/compile_queue.py): where a job is queued, what a
test module declares, and the options that cross to the worker process as JSON."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
from compile_queue import AheadQueue, Queued, compile_options, declared, json_fields


class _Owner:
    def __init__(self):
        self._ahead = {}


def test_jobs_queue_behind_the_one_named_or_first_once_it_started():
    q = AheadQueue()
    q._thread = object()  # as if its thread ran: nothing is started here
    a, b = _Owner(), _Owner()
    q.add(a, ["a1", "a2", "a3"])
    q.add(b, ["b1", "b2"], behind=(a, "a1"))
    assert q.items == [(a, "a1"), (b, "b1"), (b, "b2"), (a, "a2"), (a, "a3")]
    owner, key, future = q.steal()  # a1 starts: a job behind it now goes first
    assert (owner, key) == (a, "a1") and not future.done()
    q.add(b, ["b3"], behind=(a, "a1"))
    assert q.items[0] == (b, "b3")
    assert q.take_back(b, "b2") and not q.take_back(b, "b2")
    assert (b, "b2") not in q.items


def test_a_module_declares_its_queued_builds_alone_or_in_a_dict():
    one, two, three = (Queued(n, lambda root, model: {}) for n in ("one", "two", "three"))
    module = types.ModuleType("m")
    module.ONE, module.BY_ARCH, module.OTHER = one, {"x": two, "y": three}, {"z": 1}
    assert declared(module) == [one, two, three]


def test_options_cross_as_json_and_come_back_as_compile_options(tmp_path):
    pytest.importorskip("torch")
    fields = dict(
        model_dir=tmp_path / "m", target="vulkan-spirv", arch="lavapipe", dtype="fp16",
        out=tmp_path / "o", specs_dir=tmp_path / "s", submodules=("unet",), sizes=((40, 40),),
    )  # fmt: skip
    carried = json_fields(fields)
    assert carried["specs_dir"] == str(tmp_path / "s") and carried["submodules"] == ["unet"]
    opts = compile_options(carried)
    assert opts.model_dir == tmp_path / "m" and opts.out == tmp_path / "o"
    assert opts.specs_dir == tmp_path / "s" and isinstance(opts.specs_dir, Path)
    assert opts.submodules == ("unet",) and opts.sizes == ((40, 40),)
    assert opts.vae is None and opts.config_dir is None
