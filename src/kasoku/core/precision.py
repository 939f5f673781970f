"""What an engine computes in: one enum, torch-free (the commands offer it before torch is imported)."""

from __future__ import annotations

from enum import Enum


class Precision(str, Enum):
    """What an engine computes in. fp32 is exact and the default; every other precision has a
    fidelity contract in kasoku.core.parity's one tolerance table.

    bf16: bfloat16 compute (OpenVINO on CPUs with native bf16, AVX512-BF16 or AMX; TensorRT).
    int8: NNCF's int8 on OpenVINO: the denoiser (U-Net, SD3's and Flux's transformers) in int8
    weights and activations, calibrated on the pipeline's own denoising runs; text encoders and VAE:
    weights only (int4 weights where `CompileOptions.int4_weights` names a component, held to int8's contract).
    What is not quantized computes in bf16 where the CPU has it natively, else fp32."""

    FP32 = "fp32"
    FP16 = "fp16"
    BF16 = "bf16"
    INT8 = "int8"
