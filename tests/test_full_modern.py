"""benchmarks/full_modern.py: its parts are the families' published configurations, a reduced part's estimate comes
from FLOP counts, and --smoke runs a whole part (torch stage, kasoku's engine, the report) at toy widths."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "full_modern.py"


@pytest.fixture(scope="module")
def full_modern():
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("full_modern", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["full_modern"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("full_modern", None)
    sys.path.remove(str(SCRIPT.parent))


def test_the_published_sizes(full_modern):
    """Parameter counts of the full-size modules on the meta device: Sana Sprint 0.6B's transformer, its DC-AE,
    and a full-width Flux.2 klein 4B and Z-Image-Turbo transformer."""
    def billions(key):
        part = full_modern.Part.parse(key)
        module = full_modern.part_spec(part, real=False).load_module()
        return sum(p.numel() for p in module.parameters()) / 1e9

    assert billions("sana-0.6b/transformer@1024") == pytest.approx(0.59, abs=0.01)
    assert billions("sana-1.6b/transformer@1024") == pytest.approx(1.6, abs=0.05)
    assert billions("flux2-klein-4b/transformer@512") == pytest.approx(3.9, abs=0.15)
    assert billions("z-image-turbo/transformer@512") == pytest.approx(6.15, abs=0.1)
    assert billions("qwen-image/transformer@512") == pytest.approx(20.4, abs=0.2)


def test_a_reduced_part_is_estimated_from_the_whole_transformers_flops(full_modern):
    part = full_modern.Part.parse("flux2-klein-4b/transformer-1@256")
    spec = full_modern.part_spec(part, real=False)
    inputs = {t.name: full_modern._sample_input(t, t.shape_at(spec.profile.opt), __import__("torch").Generator())
              for t in spec.inputs}
    ratio = full_modern.whole_ratio(part, inputs)
    # 5 double- and 20 single-stream blocks against one of each, with the embeddings and output in both
    assert 8 < ratio < 25


def test_stable_diffusion_cpp_gets_flux2_in_black_forest_labs_names(tmp_path):
    """benchmarks/peer_sdcpp.py writes a diffusers Flux.2 transformer as the file stable-diffusion.cpp reads: every
    tensor once, q, k and v joined in that order, the output modulation's (scale, shift) as BFL's (shift, scale);
    a file with a tensor it has no name for is refused."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file, save_file

    spec = importlib.util.spec_from_file_location("peer_sdcpp", ROOT / "benchmarks" / "peer_sdcpp.py")
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)
    torch.manual_seed(0)
    Flux2Transformer2DModel(patch_size=1, in_channels=4, num_layers=2, num_single_layers=1, attention_head_dim=16,
                            num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=256,
                            axes_dims_rope=[4, 4, 4, 4], guidance_embeds=False).save_pretrained(tmp_path / "diffusers")
    source = tmp_path / "diffusers" / "diffusion_pytorch_model.safetensors"
    peer.write_bfl_transformer(source, tmp_path / "bfl.safetensors")
    ours, theirs = load_file(source), load_file(tmp_path / "bfl.safetensors")
    assert sum(t.numel() for t in theirs.values()) == sum(t.numel() for t in ours.values())
    attn = "transformer_blocks.1.attn."
    assert torch.equal(theirs["double_blocks.1.img_attn.qkv.weight"],
                       torch.cat([ours[attn + f"to_{x}.weight"] for x in "qkv"]))
    assert torch.equal(theirs["double_blocks.1.txt_attn.qkv.weight"],
                       torch.cat([ours[attn + f"add_{x}_proj.weight"] for x in "qkv"]))
    scale, shift = ours["norm_out.linear.weight"].chunk(2)
    assert torch.equal(theirs["final_layer.adaLN_modulation.1.weight"], torch.cat([shift, scale]))
    assert torch.equal(theirs["single_blocks.0.linear1.weight"],
                       ours["single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight"])
    save_file({**ours, "pos_embed.weight": torch.zeros(2)}, tmp_path / "other.safetensors")
    with pytest.raises(SystemExit, match=r"tensors with no BFL name: \['pos_embed.weight'\]"):
        peer.write_bfl_transformer(tmp_path / "other.safetensors", tmp_path / "refused.safetensors")


@pytest.mark.integration
@pytest.mark.slow(reason="a benchmark's own check: three processes that export and build (50 s on 2 cores)")
def test_smoke_runs_a_part_through_every_stage(tmp_path):
    results = Path("/tmp/kasoku-full_modern-smoke/results")  # the script's, for --smoke
    shutil.rmtree(results, ignore_errors=True)
    done = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--repeats", "1", "--work", str(tmp_path),
                           "--parts", "flux2-klein-4b/transformer-1@256", "--contenders", "onnxruntime:fp32"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(next(results.glob("*-full_modern.json")).read_text())
    entry = report["parts"]["flux2-klein-4b/transformer-1@256"]
    assert entry["torch"]["whole_ratio"] > 1 and entry["torch"]["bf16"]["rel_error_vs_torch"] < 0.05
    engine = entry["engines"]["onnxruntime:fp32"]
    assert engine["max_abs_vs_torch"] < 1e-4 and engine["seconds"]


IMAGE_SCRIPT = ROOT / "benchmarks" / "full_modern_image.py"


def test_the_whole_image_folder_tokenizes_as_sana_pads(full_modern):
    """The word-level tokenizer the whole-image folder holds (Gemma's cannot be downloaded): BOS first, one id per
    word or punctuation run, and Sana's padded length (its instruction's tokens + 300 - 2) as its model_max_length."""
    spec = importlib.util.spec_from_file_location("full_modern_image", IMAGE_SCRIPT)
    image = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(image)
    tokenizer = image.word_tokenizer()
    ids = tokenizer("a red fox, in the snow").input_ids
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 8 and tokenizer.unk_token_id not in ids
    instruction = len(tokenizer.encode(image._instruction()))
    assert 150 < instruction < 400 and tokenizer.model_max_length == instruction + 298


@pytest.mark.integration
@pytest.mark.slow(reason="a benchmark's own check: the folder, diffusers and a cold and warm kasoku compile (90 s)")
def test_the_whole_image_smoke_runs_diffusers_and_kasoku_cold_and_warm(tmp_path):
    results = Path("/tmp/kasoku-full_modern_image-smoke/results")  # the script's, for --smoke
    shutil.rmtree(results, ignore_errors=True)
    done = subprocess.run([sys.executable, str(IMAGE_SCRIPT), "--smoke", "--size", "256", "--repeats", "1",
                           "--work", str(tmp_path), "--contenders", "diffusers:fp32,kasoku:bf16"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(next(results.glob("*-full_modern_image.json")).read_text())
    kasoku = report["contenders"]["kasoku:bf16"]
    assert kasoku["empty_cache"] and kasoku["psnr_db"] > 30 and set(kasoku["stages"][0]) == {
        "text_encoder", "transformer", "vae_decoder"}
    # the warm start reads the recording and the engines: no export, no build, no pipeline run
    assert {status for _c, _stage, status, _s in kasoku["warm_run"]["compile_stages"]} == {"reused"}
    assert kasoku["warm_start_s"] < kasoku["compile_s"]


@pytest.mark.integration
@pytest.mark.slow(reason="a benchmark's own check: Flux.2 klein's bf16 folder, diffusers, kasoku cold and warm")
def test_the_flux2_klein_smoke_reads_the_folder_in_bf16_everywhere(tmp_path):
    results = Path("/tmp/kasoku-full_modern_image-smoke/results")
    shutil.rmtree(results, ignore_errors=True)
    done = subprocess.run([sys.executable, str(IMAGE_SCRIPT), "--smoke", "--family", "flux2-klein-4b", "--size", "256",
                           "--steps", "2", "--repeats", "1", "--work", str(tmp_path), "--contenders",
                           "diffusers:bf16,kasoku:bf16"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(next(results.glob("*-full_modern_image.json")).read_text())
    kasoku = report["contenders"]["kasoku:bf16"]
    assert report["kasoku_reads"] == "bf16" and kasoku["psnr_db"] > 30  # against diffusers' bf16 image
    assert set(kasoku["precisions"].values()) == {"bf16"}
    assert {status for _c, _stage, status, _s in kasoku["warm_run"]["compile_stages"]} == {"reused"}


def test_a_peer_export_that_runs_the_machine_out_of_memory_is_stopped_with_the_reason(monkeypatch):
    """The peers' export runs under the benchmark's memory guard: a child past the floor is killed (its whole
    process group) and the run says why, instead of the kernel's OOM killer choosing a process."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import peer_run
    finally:
        sys.path.remove(str(SCRIPT.parent))
    peer_run.run_within_memory([sys.executable, "-c", "pass"])  # memory to spare: it runs to its end
    with pytest.raises(subprocess.CalledProcessError):
        peer_run.run_within_memory([sys.executable, "-c", "raise SystemExit(3)"])
    monkeypatch.setattr(peer_run, "MEMORY_FLOOR_GIB", peer_run.available_gib() + 1024)  # no machine has that much
    with pytest.raises(SystemExit, match="stopped by the benchmark's memory guard"):
        peer_run.run_within_memory([sys.executable, "-c", "import time; time.sleep(60)"])
