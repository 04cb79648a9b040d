"""specs/README.md's full-size fp16 compile table names every GPU (target, arch) preset of the
registry for every model family, and says "refused" exactly where the registry refuses fp16, with
its reason: a preset added or refused without a full-size compile row fails here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sdiree.runtime.targets import load_registry

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import compile_matrix as matrix  # noqa: E402

SECTION = "## Full-size fp16 compiles, every GPU target and arch"
# the table's model of each family of specs/families.json, at its main size
MODELS = {"sd1": "SD 1.5 512²", "sd2": "SD 2.1 768²", "sdxl": "SDXL 1024²"}


def table_rows() -> dict[tuple[str, str, str], str]:
    text = (ROOT / "specs/README.md").read_text()
    assert SECTION in text
    body = text[text.index(SECTION) :].split("\n## ")[0]
    rows = {}
    for line in body.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 4 and cells[0] in MODELS.values():
            rows[(cells[0], cells[1], cells[2])] = cells[3]
    return rows


def test_every_gpu_preset_has_a_row_per_family_and_refusals_match_the_registry():
    rows = table_rows()
    combos = matrix.combinations(load_registry(), dtype="fp16")
    want = {(m, c["target"], c["arch"]) for m in MODELS.values() for c in combos}
    assert set(rows) == want
    for m in MODELS.values():
        for c in combos:
            result = rows[(m, c["target"], c["arch"])]
            if c["refused"]:
                assert result == f"refused: {c['refused']}"
            else:
                assert result == "compiles", (m, c, result)


def test_every_family_of_the_registry_has_its_model_in_the_table():
    families = json.loads((ROOT / "specs/families.json").read_text())["families"]
    assert set(families) == set(MODELS), "a new family needs its full-size rows in the table"
