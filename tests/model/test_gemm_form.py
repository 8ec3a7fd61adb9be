"""The small-batch GEMM form is chosen by the host kind at load; both forms compute the same product."""
import pytest
import torch

from pagedserve.model.llama import linear


@pytest.mark.parametrize("rows", [1, 2, 37, 128, 129])
def test_both_forms_agree(rows):
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    assert torch.allclose(linear(x, w, b, True), linear(x, w, b, False), atol=1e-5)
    assert linear(x, w, None, True).is_contiguous()


def test_choice_is_the_host_kinds_or_forced(default_model, monkeypatch):
    model, _ = default_model
    before = model.transposed
    try:
        for forced, want in (("transposed", True), ("linear", False)):
            monkeypatch.setenv("PAGEDSERVE_SMALL_M_GEMM", forced)
            assert "PAGEDSERVE_SMALL_M_GEMM" in model.choose_gemm_form()
            assert model.transposed is want and all(layer.transposed is want for layer in model.layers)
        monkeypatch.setenv("PAGEDSERVE_SMALL_M_GEMM", "fastest")
        with pytest.raises(ValueError, match="PAGEDSERVE_SMALL_M_GEMM"):
            model.choose_gemm_form()
        monkeypatch.delenv("PAGEDSERVE_SMALL_M_GEMM")
        assert "host kind" in model.choose_gemm_form()
    finally:
        model.transposed = before
        for layer in model.layers:
            layer.transposed = before
