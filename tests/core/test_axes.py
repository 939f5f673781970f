"""Shape axes that are products of image dimensions: a transformer's packed token count (height/16 x width/16)
is one axis, and every reader of a spec (input checks, profiles, torch.export's dims, the ONNX export and its
runtime) takes it as it takes a plain one."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from kasoku.backends import get_backend
from kasoku.core.components import (
    Axis,
    ComponentSpec,
    ImageShape,
    Precision,
    ShapeOutOfProfile,
    ShapeProfile,
    TensorSpec,
    torch_export_dims,
)

TOKENS = Axis("image_tokens", ("height", "width"), Fraction(1, 256))  # 2x2 patches of an 8x latent
IMAGES = Axis("batch", "batch")
PROFILE = ShapeProfile.from_ranges((1, 1, 2), (32, 64, 128), (32, 64, 96), multiple=16)


class Packed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 3)

    def forward(self, hidden_states, scale):
        return (self.proj(hidden_states) * scale[:, None, None],)


def packed_spec() -> ComponentSpec:
    module = Packed().eval()
    return ComponentSpec(
        name="packed",
        inputs=(TensorSpec("hidden_states", (IMAGES, TOKENS, 4)), TensorSpec("scale", (IMAGES,))),
        outputs=(TensorSpec("out", (IMAGES, TOKENS, 3)),),
        profile=PROFILE,
        load_module=lambda: module,
        weights=lambda: "packed-weights",
    )


def test_a_product_axis_is_the_product_of_its_image_dims():
    assert TOKENS.dims == ("height", "width") and TOKENS.is_product
    assert not IMAGES.is_product and IMAGES.dims == ("batch",)
    assert TOKENS.at(ImageShape(1, 64, 96)) == 4 * 6
    assert TOKENS.in_profile(PROFILE, "min") == 2 * 2 and TOKENS.in_profile(PROFILE, "max") == 8 * 6


def test_a_single_dim_axis_keeps_its_form():
    # the architecture digests of existing specs (and so their cache keys) read str(axis)
    assert str(Axis("latent_height", "height", Fraction(1, 8))) == \
        "Axis(name='latent_height', of='height', scale=Fraction(1, 8), min_scale=None)"


def test_spec_shapes_profile_and_ranges_follow_the_product():
    spec = packed_spec()
    assert spec.input_shapes(ImageShape(2, 32, 64)) == {"hidden_states": (2, 8, 4), "scale": (2,)}
    assert spec.output_shapes({"hidden_states": (2, 8, 4), "scale": (2,)}) == {"out": (2, 8, 3)}
    assert spec.profile_shapes()["hidden_states"] == ((1, 4, 4), (1, 16, 4), (2, 48, 4))
    axis, rng = spec.axes()["image_tokens"]
    assert axis is TOKENS and (rng.min, rng.opt, rng.max, rng.step) == (4, 16, 48, 1)


def test_torch_export_gives_a_product_axis_a_dim_of_its_own():
    dims = torch_export_dims(packed_spec())
    tokens = dims["image_tokens"]
    assert getattr(tokens, "root", tokens) is tokens  # not derived from a height or width Dim
    assert (tokens.min, tokens.max) == (4, 48)


def test_engines_check_a_product_axis_against_its_range():
    spec = packed_spec()
    engine = get_backend("torch").load(spec, None, Precision.FP32)
    out = engine.run({"hidden_states": torch.ones(1, 16, 4), "scale": torch.ones(1)})
    assert tuple(out["out"].shape) == (1, 16, 3)
    with pytest.raises(ShapeOutOfProfile, match="image_tokens.*4..48"):
        engine.run({"hidden_states": torch.ones(1, 64, 4), "scale": torch.ones(1)})


@pytest.mark.integration  # an ONNX export and ONNX Runtime
def test_a_product_axis_exports_dynamic_and_runs_in_onnx_runtime(tmp_path):
    from kasoku.build.export import export_component

    spec = packed_spec()
    exported = export_component(spec, tmp_path / "model.onnx", check_shapes=[ImageShape(1, 64, 64),
                                                                              ImageShape(2, 32, 96)])
    assert all(p.passed for p in exported.parity) and len(exported.parity) == 2
    assert exported.inputs["hidden_states"] == ["batch", "image_tokens", 4]
