"""tools/module_ab.py times one function across artifacts in turn, with parity to the first."""

from __future__ import annotations

import json

import module_ab  # tools/ is on sys.path: tests/conftest.py


def test_same_artifact_twice_agrees_exactly(compiled, tmp_path, capsys):
    art = compiled.get("cpu", "host", "fp32")
    report = module_ab.main(
        [str(art), str(art), "--runs", "3", "--warmup", "1", "--json", str(tmp_path / "ab.json")]
    )
    assert len(report) == 2
    for row in report:
        assert row["finite"] and row["rel_vs_first"] == 0.0
        assert 0 < row["min_s"] <= row["median_s"] <= row["max_s"]
    assert report[0]["ratio"] == 1.0 and report[1]["ratio"] > 0
    assert json.loads((tmp_path / "ab.json").read_text()) == report
    assert capsys.readouterr().out.count(str(art)) == 4  # two loads, two result rows


def test_other_function_and_submodule(compiled):
    art = compiled.get("cpu", "host", "fp32")
    (row,) = module_ab.main(
        [str(art), "--submodule", "vae_decoder", "--function", "decode", "--runs", "1"]
    )
    assert row["finite"] and row["median_s"] > 0
