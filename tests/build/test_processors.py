"""diffusers' xFormers attention processors export under exportable_attention(), untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import (
    Attention,
    AttnProcessor2_0,
    IPAdapterAttnProcessor2_0,
    IPAdapterXFormersAttnProcessor,
    XFormersAttnProcessor,
)

import kasoku
from kasoku.build.export import export_component, ort_session
from kasoku.core.components import ImageShape
from kasoku.model.pipeline_model import component_specs
from kasoku.tools.tiny import tiny_pipeline

pytestmark = pytest.mark.integration  # exports or builds engines


def test_unet_with_xformers_processors_exports_and_matches_sdpa_unet(tmp_path):
    xformers_pipe = tiny_pipeline(seed=3)
    xformers_pipe.unet.set_attn_processor(XFormersAttnProcessor())  # set directly: enable_* needs CUDA
    spec = component_specs(xformers_pipe, names=["unet"])["unet"]
    exported = export_component(spec, tmp_path / "unet.onnx")
    assert all(isinstance(p, XFormersAttnProcessor) for p in xformers_pipe.unet.attn_processors.values())

    sdpa_pipe = tiny_pipeline(seed=3)  # same weights
    sdpa_pipe.unet.set_attn_processor(AttnProcessor2_0())
    sdpa_spec = component_specs(sdpa_pipe, names=["unet"])["unet"]
    session = ort_session(exported.path)
    for shape in (ImageShape(1, 64, 64), ImageShape(2, 32, 64)):
        inputs = {k: v.numpy() for k, v in sdpa_spec.sample_inputs(shape).items()}
        onnx_out = session.run(None, inputs)[0]
        with torch.no_grad():
            torch_out = sdpa_pipe.unet(*(torch.from_numpy(inputs[n]) for n in sdpa_spec.input_names)).sample
        np.testing.assert_allclose(onnx_out, torch_out.numpy(), atol=1e-4, rtol=0)


def test_ip_adapter_xformers_processor_keeps_its_weights():
    torch.manual_seed(0)
    attn = Attention(query_dim=32, cross_attention_dim=32, heads=4, dim_head=8)
    processor = IPAdapterXFormersAttnProcessor(hidden_size=32, cross_attention_dim=32, num_tokens=(4,), scale=0.7)
    torch.nn.init.normal_(processor.to_k_ip[0].weight)
    torch.nn.init.normal_(processor.to_v_ip[0].weight)
    attn.set_processor(processor)
    weights = {k: v.clone() for k, v in processor.state_dict().items()}

    hidden = torch.randn(2, 16, 32)
    text, image = torch.randn(2, 7, 32), torch.randn(2, 4, 32)
    with kasoku.exportable_attention(), torch.no_grad():
        out = attn(hidden, encoder_hidden_states=(text, [image]))
    assert attn.processor is processor
    assert all(torch.equal(weights[k], v) for k, v in processor.state_dict().items())

    reference = IPAdapterAttnProcessor2_0(hidden_size=32, cross_attention_dim=32, num_tokens=(4,), scale=0.7)
    reference.load_state_dict(weights)
    attn.set_processor(reference)
    with torch.no_grad():
        expected = attn(hidden, encoder_hidden_states=(text, [image]))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    # the image branch matters: without the IP weights the output differs
    reference.to_v_ip[0].weight.data.zero_()
    with torch.no_grad():
        assert not torch.allclose(attn(hidden, encoder_hidden_states=(text, [image])), expected, atol=1e-3)
