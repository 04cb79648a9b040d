"""tools/trace_nonfinite.py finds the first dispatch whose outputs are not finite."""

from __future__ import annotations

import trace_nonfinite  # tools/ is on sys.path: tests/conftest.py


def test_finite_call_names_no_dispatch_and_overflow_names_the_first(compiled, tmp_path, capsys):
    art = compiled.get("cpu", "host", "fp32")
    args = [str(art), "--submodule", "vae_decoder", "--function", "decode", "--keep", str(tmp_path)]
    clean = trace_nonfinite.main(args)
    assert clean["culprit"] is None and clean["nonfinite"] == [0]
    assert clean["traced"] >= 10  # inputs and outputs of every dispatch reached the sink
    # a call on NaN inputs first leaves NaN in the memory the next call reuses: the cpu
    # module reads none of it before writing it
    poisoned = trace_nonfinite.main([*args, "--poison"])
    assert poisoned == clean
    # the weights copied to page-aligned memory (what the device imports) are the same
    # weights, and neither call wrote any of them
    aligned = trace_nonfinite.main([*args, "--poison", "--weights", "aligned"])
    assert aligned["written"] == [] and aligned["digest"] == clean["digest"]
    before = capsys.readouterr().out
    assert "parameter entries imported: 0," not in before

    # latents near float32's maximum overflow once the decoder divides by its scaling factor
    flood = trace_nonfinite.main([*args, "--input-scale", "5e37"])
    assert flood["nonfinite"][0] > 0
    assert flood["culprit"] is not None and flood["culprit"].startswith("decode")
    assert flood["culprit"].endswith("outputs")
    out = before + capsys.readouterr().out
    assert out.count("compiled the traced module") == 1  # the second run reused it (--keep)
    assert f"first non-finite outputs from finite inputs: {flood['culprit']}" in out
