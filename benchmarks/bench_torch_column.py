"""Is `kasoku bench`'s torch column what a user's torch costs? It against the pipeline's modules called directly.

    python benchmarks/bench_torch_column.py [--repeats 20] [--threads 2]

On the tiny SD 1.x pipeline at its native size: `kasoku.bench(..., backends=["onnxruntime"])`'s torch eager median
per component, and the median of the same diffusers module called as a pipeline calls it (`text_encoder(input_ids)`,
`unet(sample, t, encoder_hidden_states)`, `vae.decode(latents)`, in inference mode), on the same inputs.
The ratio should be within 20% (issue 48: the column once timed the export-only attention swap too, 0.08-0.12 s
against 0.001 s). Results: benchmarks/results/<date>-<host>-bench_torch_column.md and .json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"


def direct_calls(pipe, inputs: dict[str, dict]) -> dict[str, callable]:
    """Each component as the pipeline calls its module, on the bench's inputs."""
    import torch

    text, unet, vae = inputs["text_encoder"], inputs["unet"], inputs["vae_decoder"]
    ids = torch.as_tensor(text["input_ids"])
    sample, timestep = torch.as_tensor(unet["sample"]), torch.as_tensor(unet["timestep"])
    context, latents = torch.as_tensor(unet["encoder_hidden_states"]), torch.as_tensor(vae["latent_sample"])
    return {"text_encoder": lambda: pipe.text_encoder(ids),
            "unet": lambda: pipe.unet(sample, timestep, encoder_hidden_states=context),
            "vae_decoder": lambda: pipe.vae.decode(latents)}


def median_seconds(call, repeats: int) -> float:
    import torch

    samples = []
    with torch.inference_mode():
        call()
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import torch

    import kasoku
    from kasoku.backends.base import cpu_name
    from kasoku.model.pipeline_model import Model
    from kasoku.tools.benchmark import cpu_flags
    from kasoku.tools.tiny import tiny_pipeline

    torch.set_num_threads(args.threads)
    pipe = tiny_pipeline()
    components = ["text_encoder", "unet", "vae_decoder"]
    report = kasoku.bench(pipe, ["onnxruntime"], repeats=args.repeats, components=components, threads=args.threads,
                          end_to_end=False)
    specs = Model.of(pipe).specs(None, components)
    shape = next(iter(specs.values())).profile.opt
    inputs = {name: spec.sample_inputs(shape, seed=3) for name, spec in specs.items()}
    calls = direct_calls(pipe, inputs)
    rows = []
    for entry in report.components:
        column = entry.results["torch"].seconds.median
        direct = median_seconds(calls[entry.component], args.repeats)
        rows.append({"component": entry.component, "bench_torch_s": column, "direct_s": direct,
                     "ratio": column / direct})
    machine = {"cpu": cpu_name(), "flags": cpu_flags(), "threads": args.threads, "torch": torch.__version__,
               "date": datetime.date.today().isoformat()}
    lines = [f"# kasoku bench's torch column against the modules called directly ({machine['date']})", "",
             f"{machine['cpu']} ({', '.join(machine['flags']) or 'no AVX-512/AMX'}), {args.threads} threads, the tiny "
             f"SD 1.x pipeline at {shape.height}x{shape.width}, medians of {args.repeats}; "
             "`python benchmarks/bench_torch_column.py`.", "",
             "| component | kasoku bench torch | module called directly | ratio |", "|---|---|---|---|"]
    lines += [f"| {r['component']} | {r['bench_torch_s'] * 1e3:.2f} ms | {r['direct_s'] * 1e3:.2f} ms | "
              f"{r['ratio']:.2f} |" for r in rows]
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"{machine['date']}-{socket.gethostname()}-bench_torch_column"
    stem.with_suffix(".json").write_text(json.dumps({"machine": machine, "rows": rows}, indent=2) + "\n")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
