"""`kasoku bench` on the tiny pipeline: a JSON with every field, and a PNG chart when asked."""

from __future__ import annotations

import json

import pytest

from kasoku.cli import main

pytestmark = pytest.mark.integration  # exports or builds engines


@pytest.mark.slow(reason="a full bench run (the families' bench tests stay)")
def test_bench_reports_every_field(tiny_dir, tmp_path, capsys):
    out, chart = tmp_path / "bench.json", tmp_path / "bench.png"
    # no --cache-dir: a fresh cache, so compile times are cold ones
    assert main(["bench", str(tiny_dir), "--backends", "onnxruntime,openvino,onnxruntime-defaults",
                 "--components", "text_encoder", "unet", "vae_decoder", "--steps", "2", "--repeats", "3",
                 "--json", str(out), "--plot", str(chart)]) == 0
    report = json.loads(out.read_text())
    assert report["matmul_gflops"] > 1 and report["threads"] >= 1 and report["repeats"] == 3
    assert report["machine"]["cpu"] and report["peak_rss_mb"] > 0
    assert [c["component"] for c in report["components"]] == ["text_encoder", "unet", "vae_decoder"]
    for component in report["components"]:
        assert component["gflop"] > 0 and component["floor_s"] > 0
        results = component["results"]
        assert set(results) == {"torch", "onnxruntime", "openvino", "onnxruntime-defaults"}
        for name, r in results.items():
            s = r["seconds"]
            assert 0 < s["min"] <= s["median"] <= s["max"], name
            assert r["speedup_vs_torch"] > 0 and r["time_over_floor"] > 0 and r["rss_mb"] > 0
            assert r["max_abs_vs_torch"] < 1e-3, name  # checked while timing
            if name != "torch":
                assert r["first_call_s"] > 0 and r["warm_load_s"] >= 0
        for name in ("onnxruntime", "openvino"):
            assert results[name]["cold_compile_s"] > 0 and results[name]["warm_load_s"] > 0
    e2e = report["end_to_end"]
    assert e2e["steps"] == 2 and len(e2e["results"]) == 2
    for name, r in e2e["results"].items():
        assert r["seconds_per_image"]["median"] > 0 and r["steps_per_s"] > 0
        assert r["max_abs_vs_diffusers"] < 1e-3, name
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    assert "End to end" in text and "Peak resident memory" in text and "Columns: median s is the middle" in text


def test_bench_refuses_fewer_than_three_repeats(tiny_dir, capsys):
    with pytest.raises(SystemExit) as exited:  # argparse's refusal: one line, exit status 2
        main(["bench", str(tiny_dir), "--repeats", "2"])
    assert exited.value.code == 2
    assert "--repeats: expected at least 3 repeats (a median of repeats), got '2'" in capsys.readouterr().err


def test_a_wide_spread_is_said_to_be_unsteady():
    from kasoku.tools.benchmark import spread_warnings

    (line,) = spread_warnings({"unet on openvino": (1.0, 2.4), "vae on openvino": (1.0, 1.2)})
    assert line.startswith("unet on openvino's calls took 1–2.4 s (2.4x apart): the machine was busy")
