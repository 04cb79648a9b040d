"""tools/op_parity.py builds per-op modules with flag variants and reports each one's error."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

import op_parity  # noqa: E402  (tools/ is on sys.path: tests/conftest.py)


def test_build_and_run_report_every_op_and_variant(tmp_path, capsys):
    out = tmp_path / "ops"
    args = ["build", str(out), "--target", "cpu", "--arch", "host", "--dtype", "fp32"]
    variants = ["--variant", "base=", "--variant", "bad=--no-such-flag"]
    assert op_parity.main([*args, *variants, "--only", "linear", "conv1x1"]) == 0
    index = json.loads((out / "index.json").read_text())
    assert index["ops"] == {
        "linear": {"base": True, "bad": False},
        "conv1x1": {"base": True, "bad": False},
    }
    capsys.readouterr()
    assert op_parity.main(["run", str(out), "--driver", "local-task"]) == 0
    rows = {}
    for line in capsys.readouterr().out.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in ("linear", "conv1x1"):
            rows[cells[0]] = cells[1:]
    assert set(rows) == {"linear", "conv1x1"}
    for op, (base, bad) in rows.items():
        assert float(base) < 1e-5, (op, base)  # fp32 against torch fp32
        assert bad == "FAIL"
