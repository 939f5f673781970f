"""int8 through NNCF, the OpenVINO toolkit's own quantizer (no hand-written quantizer here).

Three recipes, chosen per component by its spec (`ComponentSpec.int8`):

- "weights" (text encoders, the VAE, the ControlNets): weight-only int8 (`nncf.compress_weights`, INT8_ASYM),
  data-free. OpenVINO's CPU plugin runs compressed MatMul weights in its FullyConnected kernels: where the CPU has
  VNNI or AMX it quantizes their activations on the fly (by groups of channels, `openvino.DYNAMIC_QUANTIZATION_GROUP`)
  and multiplies in int8, else it widens the weights inside its bf16 or fp32 kernels; compressed convolutions are
  decompressed when the model is compiled, so they save disk and memory, not time.
- "int4-weights" (an LLM text encoder, where `CompileOptions.int4_weights` names it): weight-only int4 (INT4_ASYM,
  groups of 128 input channels, NNCF's defaults for LLMs), data-free; the embeddings and the last layer stay in int8
  (NNCF's backup mode). Half the bytes of int8 weights, for the text encoders that are most of a new family's
  weights. Held to int8's contract: on Gemma 2 and Qwen3-4B at full width with random weights it missed it (four
  layers: relative errors 0.30 and 0.51; Gemma 2 whole: 0.43) and ran no faster than int8 weights on a Xeon with AMX
  at 77 to 512 tokens (docs/BENCHMARKS.md), so its engines were refused there; a trained checkpoint's weights may
  quantize otherwise.
- "full" (the denoisers: U-Net and transformers): int8 weights and activations for every layer NNCF quantizes
  (convolutions, linear layers, the attention's products), calibrated on the denoiser's inputs recorded during the
  pipeline's own denoising runs (see :mod:`kasoku.policies.calibration`): preset MIXED, transformer model type, no
  SmoothQuant and no bias correction. On a CPU with VNNI the int8 kernels run about twice bf16's rate (OpenVINO, one
  linear layer of SD3.5's width, Zen 4: 729 against 377 GOP/s). It replaced optimum-intel's hybrid recipe (linear layers
  weight-only, computing in bf16), which left a third of the SD 1.5 U-Net's time in bf16 linear layers: 4 LCM steps
  with TAESD took 6.47 s with it and 5.92 s without, at 54.3 and 54.0 dB from diffusers fp32 (random weights; a real
  checkpoint's activation outliers could not be measured here). The overflow fix (7-bit weights) is on where the CPU
  has no VNNI or AMX, whose int8 products do not saturate (OpenVINO's saturation note); on an AVX2-only CPU the tiny
  U-Net missed the int8 contract without it (with the hybrid recipe: relative error 0.219 against 0.2).

A graph read in bf16 (its weights, inputs and outputs bf16) is quantized from its bf16 weights: both recipes run on
the graph widened (:func:`widened`: every bf16 weight behind a Convert to fp32, the decompression form NNCF reads
weights through, and fp32 inputs for the fp32 samples NNCF calibrates with), and the quantized graph gets its bf16
inputs and outputs back (:func:`with_bf16_io`). Compressed as they are, bf16 weights decompress through fp16, which
OpenVINO's CPU plugin does not fuse into its linear layers: it decompressed them on every call. On the Zen 5 of
docs/BENCHMARKS.md, two linear layers of Flux.2's width over 1536 tokens took 219 ms in bf16, 201 ms with int8 weights
compressed in bf16, 169 ms compressed widened (u8 weights in its FullyConnected kernels, their activations quantized
on the fly by OpenVINO's default groups; kasoku's group, and its figures: `openvino.DYNAMIC_QUANTIZATION_GROUP`), and
about 110 ms with calibrated int8 activations (the full recipe).

Before any recipe, weights that reach a MatMul through a Transpose are folded into the MatMul's own
`transpose_b` (:func:`fold_weight_transposes`): torch's exporter writes every `nn.Linear` on a 3-D input so,
and NNCF sees no weight behind a Transpose. Without the fold it compressed 14 of the SD3.5 transformer's 69
linear layers and quantized none of them.
"""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..core.errors import KasokuError

NNCF_EXTRA = "pip install 'kasoku[openvino]'"
INT4_RECIPE = "int4-weights"
RECIPES = ("weights", INT4_RECIPE, "full")
INT4_GROUP = 128  # input channels per int4 scale: NNCF's default for LLM weights
CALIBRATED = ("full",)  # the recipes that quantize activations, on recorded inputs
# Bumped when a recipe quantizes other layers than before: it is part of every int8 engine's key.
# 2: weights behind a Transpose are quantized (fold_weight_transposes); "full" replaces "hybrid".
RECIPES_VERSION = 2


class QuantizationError(KasokuError):
    """NNCF is missing, or a model could not be quantized."""


def _nncf():
    try:
        import nncf
    except ImportError:
        raise QuantizationError(f"--precision int8 needs NNCF, which is not installed here: {NNCF_EXTRA}") from None
    nncf.set_log_level(logging.ERROR)  # its statistics tables are for its own developers; kasoku reports the result
    return nncf


@contextlib.contextmanager
def _quiet():
    """NNCF draws progress bars on stdout; kasoku shows its own stage spinner."""
    with contextlib.redirect_stdout(io.StringIO()):
        yield


def _comes_from_constant(output) -> bool:
    node = output.get_node()
    while node.get_type_name() == "Convert":
        node = node.input_value(0).get_node()
    return node.get_type_name() == "Constant"


def _transposed_constant(output):
    """The weight behind `output` when it is Transpose(constant, [1, 0]) (possibly through a Convert), else None."""
    transpose = output.get_node()
    if transpose.get_type_name() != "Transpose" or len(transpose.output(0).get_target_inputs()) != 1:
        return None
    order = transpose.input_value(1).get_node()
    if order.get_type_name() != "Constant" or [int(v) for v in order.get_data()] != [1, 0]:
        return None
    weight = transpose.input_value(0)
    return weight if _comes_from_constant(weight) else None


def fold_weight_transposes(model):
    """MatMul(x, Transpose(W)) becomes MatMul(x, W, transpose_b flipped), in place: the same product, with the
    weight where NNCF looks for one. No weight is copied."""
    import openvino.opset13 as ops

    for node in model.get_ordered_ops():
        if node.get_type_name() != "MatMul":
            continue
        weight = _transposed_constant(node.input_value(1))
        if weight is None:
            continue
        folded = ops.matmul(node.input_value(0), weight, node.get_transpose_a(), not node.get_transpose_b())
        folded.set_friendly_name(node.get_friendly_name())
        node.output(0).replace(folded.output(0))
    return model


def weights_only(model):
    """int8 weights (asymmetric, per channel), data-free."""
    nncf = _nncf()
    with _quiet():
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT8_ASYM)


def int4_weights_only(model):
    """int4 weights (asymmetric, by groups of INT4_GROUP input channels), the embeddings and the last layer in int8;
    data-free."""
    nncf = _nncf()
    # a layer narrower than a group, or not a multiple of one, gets the largest power-of-two group that divides it
    # (at least 32 channels), else int8 weights
    adjusted = nncf.AdvancedCompressionParameters(group_size_fallback_mode=nncf.GroupSizeFallbackMode.ADJUST)
    with _quiet():
        return nncf.compress_weights(model, mode=nncf.CompressWeightsMode.INT4_ASYM, group_size=INT4_GROUP, ratio=1.0,
                                     backup_mode=nncf.BackupMode.INT8_ASYM, advanced_parameters=adjusted)


def overflow_fix() -> str:
    """NNCF's overflow fix for this CPU: "enable" (7-bit weights) where its int8 products saturate, else "disable"."""
    from .base import has_int8_dot_product

    return "disable" if has_int8_dot_product() else "enable"


def _is_bf16(output) -> bool:
    import openvino as ov

    return output.get_element_type() == ov.Type.bf16


def read_in_bf16(model) -> bool:
    """Whether `model` is a graph read in bf16: a floating-point input or output of it is bf16."""
    return any(_is_bf16(port) for port in (*model.inputs, *model.outputs))


def widened(model):
    """`model` (a graph read in bf16), in place, computing in fp32 from the same bf16 weights: each bf16 constant
    behind a Convert to fp32 (no weight is copied), bf16 inputs and casts fp32. Returns the names of the inputs and
    the indices of the outputs that were bf16, for :func:`with_bf16_io`."""
    import openvino as ov
    import openvino.opset13 as ops

    inputs = [port.get_any_name() for port in model.inputs if _is_bf16(port)]
    outputs = [index for index, port in enumerate(model.outputs) if _is_bf16(port)]
    for node in model.get_ordered_ops():
        kind = node.get_type_name()
        if kind == "Parameter" and _is_bf16(node.output(0)):
            node.set_element_type(ov.Type.f32)
        elif kind == "Constant" and _is_bf16(node.output(0)):
            targets = list(node.output(0).get_target_inputs())
            decompressed = ops.convert(node, ov.Type.f32)
            for target in targets:
                target.replace_source_output(decompressed.output(0))
        elif kind == "Convert" and _is_bf16(node.output(0)):
            node.output(0).replace(ops.convert(node.input_value(0), ov.Type.f32).output(0))
    model.validate_nodes_and_infer_types()
    return inputs, outputs


def with_bf16_io(model, inputs: Sequence[str], outputs: Sequence[int]):
    """`model` (widened, then quantized) taking `inputs` and giving `outputs` in bf16 again, as its spec says."""
    import openvino as ov
    import openvino.opset13 as ops

    for port in model.inputs:
        if port.get_any_name() in inputs:
            parameter = port.get_node()
            targets = list(parameter.output(0).get_target_inputs())
            parameter.set_element_type(ov.Type.bf16)
            widen = ops.convert(parameter, ov.Type.f32)
            for target in targets:
                target.replace_source_output(widen.output(0))
    for index in outputs:
        result = model.get_results()[index]
        result.input(0).replace_source_output(ops.convert(result.input_value(0), ov.Type.bf16).output(0))
    model.validate_nodes_and_infer_types()
    return model


def full(model, samples: Sequence[dict[str, Any]]):
    """int8 weights and activations wherever NNCF quantizes, calibrated on `samples` (see the module docstring)."""
    nncf = _nncf()
    if not samples:
        raise QuantizationError("full int8 needs calibration samples; none were recorded.")
    # SmoothQuant and bias correction off: each holds another copy of the weights while it works (4-layer SD3.5
    # width: peak anonymous memory 5.2 GB with both, 2.7 GB without, for a 2.2 GB model), for the same speed; the
    # tiny SD3's 20-step image against fp32 was 33.9 dB with both, 37.0 dB without.
    advanced = nncf.AdvancedQuantizationParameters(
        overflow_fix=nncf.OverflowFix(overflow_fix()), disable_bias_correction=True,
        smooth_quant_alphas=nncf.AdvancedSmoothQuantParameters(matmul=-1))
    with _quiet():
        return nncf.quantize(
            model, nncf.Dataset(list(samples)), preset=nncf.QuantizationPreset.MIXED, subset_size=len(samples),
            fast_bias_correction=True, model_type=nncf.ModelType.TRANSFORMER, advanced_parameters=advanced)


def quantize(model, recipe: str, samples: Sequence[dict[str, Any]] | None = None):
    """The int8 model of `recipe` (one of RECIPES)."""
    quantizers = {"weights": weights_only, INT4_RECIPE: int4_weights_only,
                  "full": lambda graph: full(graph, samples or [])}
    if recipe not in quantizers:
        raise ValueError(f"unknown int8 recipe {recipe!r}; recipes are {RECIPES}")
    return quantized_as_read(model, quantizers[recipe])


def quantized_as_read(model, quantizer: Callable[[Any], Any]):
    """`quantizer` applied to `model` with its weights' transposes folded; a graph read in bf16 is quantized widened
    and gets its bf16 inputs and outputs back (see the module docstring)."""
    model = fold_weight_transposes(model)
    bf16_io = widened(model) if read_in_bf16(model) else None
    quantized = quantizer(model)
    return quantized if bf16_io is None else with_bf16_io(quantized, *bf16_io)
