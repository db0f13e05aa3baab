"""Per-kind precision helpers and the dynamic loss scaler's arithmetic (no distribution needed)."""

import math

import pytest
import torch

from hethub.runtime.precision import DynamicLossScaler, autocast, boundary_dtype, compute_dtype


def test_compute_and_boundary_dtypes() -> None:
    assert compute_dtype("bf16-mixed") is torch.bfloat16 and compute_dtype("fp16-mixed") is torch.float16
    assert compute_dtype("fp32") is None and boundary_dtype("fp32") is torch.float32
    assert boundary_dtype("fp16-mixed") is torch.float16
    with pytest.raises(ValueError, match="fp8"):
        compute_dtype("fp8")


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("fp16-mixed", torch.float16),
                                                  ("fp32", torch.float32)])
def test_autocast_on_cpu(precision: str, dtype: torch.dtype) -> None:
    a = torch.randn(4, 4)
    with autocast(torch.device("cpu"), precision):
        assert (a @ a).dtype == dtype


def test_scaler_backs_off_on_overflow_and_grows_after_good_steps() -> None:
    s = DynamicLossScaler(scale=1024.0, growth_interval=3)
    assert DynamicLossScaler.overflowed(math.inf) and DynamicLossScaler.overflowed(math.nan)
    assert not DynamicLossScaler.overflowed(1e30)
    s.update(overflow=True)
    s.update(overflow=True)
    assert s.scale == 256.0 and s.skipped_steps == 2 and s.good_steps == 0
    for _ in range(2):
        s.update(overflow=False)
    assert s.scale == 256.0
    s.update(overflow=False)  # the third good step in a row doubles it
    assert s.scale == 512.0 and s.good_steps == 0
    s.update(overflow=False)
    s.update(overflow=True)  # an overflow resets the count of good steps
    assert s.scale == 256.0 and s.good_steps == 0
    tiny = DynamicLossScaler(scale=1.0)
    tiny.update(overflow=True)
    assert tiny.scale == 1.0  # never below min_scale
