"""The CLI end to end on the tiny pipeline."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from kasoku.cli import build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in build_parser()._subparsers._group_actions[0].choices:
        assert name in out


@pytest.mark.integration
def test_demo_runs_end_to_end(tmp_path, tiny_cache, capsys):
    image = tmp_path / "demo.png"
    args = ["demo", "--workdir", str(tmp_path), "-o", str(image), "--cache-dir", str(tiny_cache.root)]
    assert main([*args, "--json", str(tmp_path / "demo.json")]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "parity: PASSED" in out
    report = json.loads((tmp_path / "demo.json").read_text())
    assert report["passed"] and report["image_psnr_db"] >= 40
    assert {p["component"] for p in report["component_parity"]} == {"text_encoder", "unet", "vae_decoder",
                                                                     "vae_encoder"}
    assert set(report["timing"]) == {"diffusers (torch eager)", "kasoku"}
    assert Image.open(image).size == (64, 64)
    # second run: every cache entry reused
    assert main([*args, "--json", str(tmp_path / "demo2.json")]) == 0
    again = json.loads((tmp_path / "demo2.json").read_text())
    assert {s["status"] for s in again["compile"]["stages"]} == {"reused"}


def _generate(tiny_dir, tiny_cache, out, *extra):
    return main(["generate", str(tiny_dir), "a photo of a cat", "-o", str(out), "--steps", "3",
                 "--backend", "onnxruntime", "--cache-dir", str(tiny_cache.root), *extra])


def test_generate_txt2img_img2img_inpaint(tiny_dir, tiny_cache, tiny_compiled, tmp_path, capsys):
    assert _generate(tiny_dir, tiny_cache, tmp_path / "a.png", "--num-images", "2", "--scheduler", "ddim") == 0
    assert Image.open(tmp_path / "a-0.png").size == (64, 64) and (tmp_path / "a-1.png").exists()
    out = capsys.readouterr().out
    assert "time per stage" in out and "unet" in out and "txt2img" in out
    init = tmp_path / "a-0.png"
    assert _generate(tiny_dir, tiny_cache, tmp_path / "b.png", "--image", str(init), "--strength", "0.5") == 0
    assert "img2img" in capsys.readouterr().out
    mask = np.zeros((64, 64), np.uint8)
    mask[16:48, 16:48] = 255
    Image.fromarray(mask).save(tmp_path / "mask.png")
    assert _generate(tiny_dir, tiny_cache, tmp_path / "c.png", "--image", str(init), "--mask",
                     str(tmp_path / "mask.png")) == 0
    assert "inpaint" in capsys.readouterr().out and (tmp_path / "c.png").exists()


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--height", "60"], "must be multiples of 16 for this model"),
        (["--image", "missing.png"], "--image missing.png does not exist"),
        (["--strength", "2", "--image", "IMG"], "argument --strength: expected a number in [0, 1], got '2'"),
    ],
    ids=["not-divisible", "missing-image", "strength"],
)
def test_generate_bad_input_writes_nothing(tiny_dir, tiny_cache, tiny_compiled, tmp_path, capsys, extra, message):
    Image.new("RGB", (64, 64)).save(tmp_path / "in.png")
    extra = [str(tmp_path / "in.png") if e == "IMG" else e for e in extra]
    out = tmp_path / "out" / "x.png"
    out.parent.mkdir()
    try:
        code = _generate(tiny_dir, tiny_cache, out, *extra)
    except SystemExit as exit_:  # refused by the parser
        code = exit_.code
    assert code in (1, 2)
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
    assert list(out.parent.iterdir()) == []


def test_generate_output_folder_must_exist(tiny_dir, tmp_path, capsys):
    from kasoku.core.cache import Cache

    cache = Cache(tmp_path / "cache")
    assert _generate(tiny_dir, cache, tmp_path / "nope" / "x.png") == 1
    assert "does not exist" in capsys.readouterr().out
    assert not cache.list()  # refused before any engine was built


def _piped(*argv: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kasoku.cli", *argv], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


# what the libraries kasoku calls print for their own developers
THIRD_PARTY = ("torchvision", "WARNING", "Warning", "xFormers", "[transformers]", "Loading pipeline components",
               "Loading weights", "_registration.py")


@pytest.mark.integration
def test_compile_piped_prints_kasoku_lines_only_and_verbose_shows_the_rest(tiny_dir, tmp_path):
    """`kasoku compile` (a text encoder and a VAE), piped into a log: its stages and table, no third-party warning
    line; `-v` shows the exporter's own lines again (torch.onnx's note on torchvision's operators, which kasoku does
    not export)."""
    quiet = _piped("compile", str(tiny_dir), "--components", "text_encoder", "vae_decoder", "--backend",
                   "onnxruntime", "--cache-dir", str(tmp_path / "quiet"))
    noisy = [line for line in quiet.splitlines() if any(word in line for word in THIRD_PARTY)]
    assert noisy == [], quiet
    assert "vae_decoder: export …" in quiet and "0 reused from the cache" in quiet
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed here: the exporter has no note on its operators to show")
    verbose = _piped("-v", "compile", str(tiny_dir), "--components", "text_encoder", "--backend", "onnxruntime",
                     "--cache-dir", str(tmp_path / "verbose"))
    assert "torchvision::nms" in verbose, verbose


@pytest.mark.parametrize("argv, verbose", [
    (["compile", "m"], False), (["-v", "compile", "m"], True), (["compile", "m", "-v"], True),
    (["generate", "m", "a cat", "--verbose"], True), (["cache", "ls"], False), (["--verbose", "cache", "ls"], True),
])
def test_verbose_is_taken_before_or_after_the_command(argv, verbose):
    assert build_parser().parse_args(argv).verbose is verbose
