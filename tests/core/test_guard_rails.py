"""Guard rails: an engine output that is NaN or Inf, or a decoded image / denoiser prediction of one value everywhere,
is an error that names the component and its precision; it is never returned as an image."""

from __future__ import annotations

import pytest
import torch

from kasoku.core.components import Precision
from kasoku.core.standins import BrokenEngineOutput, check_outputs


def test_a_nan_engine_output_is_caught_and_named(tiny_kasoku):
    latents = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    latents[0, 0, 0, 0] = float("nan")  # the U-Net engine computes NaN from it: what an overflow would give
    tiny_kasoku.times.reset()
    with pytest.raises(BrokenEngineOutput, match=r"the unet engine \(fp32\) gave \d+ NaN/Inf"):
        tiny_kasoku("a cat", latents=latents, num_inference_steps=2, output_type="np")
    assert tiny_kasoku.times.calls["unet"] == 1 and tiny_kasoku.times.calls["vae_decoder"] == 0  # stopped at once
    finite = tiny_kasoku("a cat", latents=latents.nan_to_num(), num_inference_steps=2, output_type="np").images
    assert torch.isfinite(torch.as_tensor(finite)).all()  # the same call without the NaN runs


def test_a_blank_image_or_prediction_is_an_error_but_zero_residuals_are_not():
    with pytest.raises(BrokenEngineOutput, match=r"vae_decoder engine \(bf16\).*one value everywhere"):
        check_outputs("vae_decoder", Precision.BF16, {"sample": torch.full((1, 3, 8, 8), -1.0)})
    with pytest.raises(BrokenEngineOutput, match="transformer engine"):
        check_outputs("transformer", Precision.FP32, {"out_sample": torch.tensor([[1.0, float("inf")]])})
    check_outputs("controlnet_0", Precision.FP32, {"down_0": torch.zeros(1, 4, 8, 8)})  # conditioning scale 0
    check_outputs("vae_decoder", Precision.FP32, {"sample": torch.rand(1, 3, 8, 8)})
