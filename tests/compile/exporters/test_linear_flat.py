"""`linear: "flat"`: a Linear on a 3-D input traced as one 2-D matmul computes the same values,
and "native" gives the class's forward back."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from sdiree.compile.exporters.linear_flat import set_linear_lowering  # noqa: E402


def test_flat_linear_equals_native_and_is_undone():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4, bias=False)
    )
    x3, x2 = torch.randn(1, 5, 8), torch.randn(5, 8)
    want3, want2 = model(x3), model(x2)
    assert set_linear_lowering(model, "flat") == 2
    assert "forward" in model[0].__dict__
    torch.testing.assert_close(model(x3), want3, rtol=0, atol=1e-6)
    torch.testing.assert_close(model(x2), want2, rtol=0, atol=0)
    assert set_linear_lowering(model, "native") == 2
    assert "forward" not in model[0].__dict__
    with pytest.raises(ValueError):
        set_linear_lowering(model, "bogus")


def _linear_input_dims(lin) -> list[int]:
    ep = torch.export.export(lin, (torch.randn(1, 5, 8),))
    return [
        n.args[0].meta["val"].dim()
        for n in ep.graph.nodes
        if n.op == "call_function" and "linear" in str(n.target)
    ]


def test_flat_linear_traces_a_2d_matmul():
    """Traced natively, the Linear gets the 3-D input (which iree-turbine lowers to a batch
    matmul against the expanded, transposed weight); flat, a 2-D one."""
    lin = torch.nn.Linear(8, 16)
    assert _linear_input_dims(lin) == [3]
    set_linear_lowering(lin, "flat")
    assert _linear_input_dims(lin) == [2]
