"""Two linear layers of a family's width (x @ W1, GELU, @ W2) read in bf16, on OpenVINO's CPU plugin: bf16, and int8
weights (kasoku's "weights" recipe) with the activations quantized on the fly by each group size asked for; the time
of a call and the relative RMS error against float64. It is what chose `openvino.DYNAMIC_QUANTIZATION_GROUP`.

    python benchmarks/int8_linear_groups.py [--tokens 1536 --width 3072 --hidden 9216] [--groups 0,32,128] [--int4]

Flux.2 klein 4B's widths are the defaults (1536 tokens: a 512x512 image and 512 text tokens); Sana 0.6B: --tokens
1024 --width 1152 --hidden 2880; Qwen3-4B over a 512-token prompt: --tokens 512 --width 2560 --hidden 9728. Group 0
turns dynamic quantization off (the weights are widened inside bf16 kernels).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def weights(width: int, hidden: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The two layers' weights, in bf16."""
    generator = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=generator) * 0.02).bfloat16() for shape in ((hidden, width),
                                                                                          (width, hidden)))


def two_linear_layers(tokens: int, up: torch.Tensor, down: torch.Tensor):
    """The layers as a graph read in bf16: bf16 input, weights and output."""
    import openvino as ov
    import openvino.opset13 as ops

    def constant(weight: torch.Tensor):
        return ops.constant(weight.float().numpy(), ov.Type.bf16)  # exact: the values are bf16 already

    x = ops.parameter([1, tokens, up.shape[1]], ov.Type.bf16, name="x")
    hidden_states = ops.gelu(ops.matmul(x, constant(up), False, True), "tanh")
    return ov.Model([ops.matmul(hidden_states, constant(down), False, True)], [x], "two-linear-layers")


def timed(model, config: dict, x: torch.Tensor, repeats: int) -> tuple[float, torch.Tensor]:
    """(median seconds of a call after two warm-ups, its output as fp32): bf16 in and out, as the graph takes them."""
    import openvino as ov

    from kasoku.backends.openvino import ov_tensor

    request = ov.Core().compile_model(model, "CPU", config).create_infer_request()
    given, out = x.to(torch.bfloat16), torch.empty(x.shape, dtype=torch.bfloat16)
    request.set_input_tensor(ov_tensor(given))  # shares `given`'s memory, which must outlive the calls
    request.set_output_tensor(ov_tensor(out))
    for _ in range(2):
        request.infer()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        request.infer()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds), out.float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1536)
    parser.add_argument("--width", type=int, default=3072)
    parser.add_argument("--hidden", type=int, default=9216)
    parser.add_argument("--groups", default="0,32,64,128,192,256,512")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--int4", action="store_true",
                        help="int4 weights too (NNCF's INT4_SYM by groups of 128, every layer), which kasoku does not "
                             "build: what they would gain")
    args = parser.parse_args()

    from kasoku.backends.base import cpu_flags, cpu_name
    from kasoku.backends.int8 import quantize
    from kasoku.backends.openvino import openvino_config
    from kasoku.core.components import Precision

    flags = sorted(f for f in cpu_flags() if "vnni" in f or "bf16" in f or "amx" in f)
    print(f"{cpu_name()} ({', '.join(flags)}), {args.threads} threads; "
          f"{args.tokens} tokens, {args.width} -> {args.hidden} -> {args.width}")
    x = torch.randn((1, args.tokens, args.width), generator=torch.Generator().manual_seed(1)).bfloat16().float()
    up, down = weights(args.width, args.hidden)
    # the reference: the same bf16 input and weights in float64
    gelu = torch.nn.functional.gelu(x.double() @ up.double().T, approximate="tanh")
    reference = (gelu @ down.double().T).float()

    def row(label: str, seconds: float, out: torch.Tensor) -> None:
        error = ((out - reference).pow(2).mean() / reference.pow(2).mean()).sqrt().item()
        print(f"{label:32s} {seconds * 1e3:8.1f} ms   relative RMS error {error:.2%}", flush=True)

    config = openvino_config(Precision.BF16, args.threads)  # kasoku's bf16 engines'; an int8 one's sets the group
    row("bf16", *timed(two_linear_layers(args.tokens, up, down), config, x, args.repeats))
    compressed = {"int8": quantize(two_linear_layers(args.tokens, up, down), "weights")}
    if args.int4:
        compressed["int4"] = int4_weights(two_linear_layers(args.tokens, up, down))
    for kind, model in compressed.items():
        for group in args.groups.split(","):
            row(f"{kind} weights, groups of {group}", *timed(
                model, {**config, "DYNAMIC_QUANTIZATION_GROUP_SIZE": group}, x, args.repeats))


def int4_weights(model):
    """NNCF's int4 weights (symmetric, groups of 128) on the graph as kasoku's int8 recipes quantize it."""
    import nncf

    from kasoku.backends.int8 import quantized_as_read

    return quantized_as_read(model, lambda graph: nncf.compress_weights(
        graph, mode=nncf.CompressWeightsMode.INT4_SYM, group_size=128, ratio=1.0, all_layers=True))


if __name__ == "__main__":
    main()
