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
    assert " outputs" in flood["culprit"]  # "outputs", or "outputs with {0} decoded to ..."
    out = before + capsys.readouterr().out
    assert out.count("compiled the traced module") == 1  # the second run reused it (--keep)
    assert f"first non-finite outputs from finite inputs: {flood['culprit']}" in out


def _sink(rows):
    sink = trace_nonfinite.NonFiniteSink(verbose=False)
    sink.rows = [(key, [(tuple(s), bad, 1.0) for s, bad in stats]) for key, stats in rows]
    return sink


def test_memory_filled_in_by_the_next_copies_is_no_culprit():
    """Seen on a Zen 5 after --poison: iree's Winograd input tiles are copied one by one into
    memory the NaN call left NaN; each copy's output holds the NaN not yet written over."""
    tile, whole = (6, 2, 2, 4), (6, 3, 1, 2, 2, 4)
    filled = [
        ("d_1 inputs", [(tile, 0), (whole, 0)]),  # traced before: another buffer's contents
        ("d_1 outputs", [(whole, 96)]),
        ("d_2 inputs", [(tile, 0), (whole, 96)]),
        ("d_2 outputs", [(whole, 48)]),
        ("d_3 inputs", [(tile, 0), (whole, 48)]),
        ("d_3 outputs", [(whole, 0)]),
        ("d_4 inputs with {0} decoded to row major layout", [(whole, 0)]),
        ("d_4 outputs with {0} decoded to row major layout", [(tile, 0)]),
    ]
    assert _sink(filled).first_culprit() is None
    # the chain left some: the first copy is named; so is an output no copy takes next
    assert _sink(filled[:4] + [("d_4 inputs", [(whole, 48)])]).first_culprit() == "d_1 outputs"
    assert _sink(filled[:2] + filled[6:]).first_culprit() == "d_1 outputs"
    made = [
        ("d_9 inputs with {0} decoded", [(tile, 0)]),
        ("d_9 outputs with {0} decoded", [(tile, 3)]),
    ]
    assert _sink(made).first_culprit() == "d_9 outputs with {0} decoded"
