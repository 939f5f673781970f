"""Weights by name (kasoku.core.weights) and LoRA arithmetic (kasoku.runtime.lora), without engines: the names an
architecture graph binds, PEFT layers merged as PEFT computes them, and the adapter state's rules."""

from __future__ import annotations

import json

import pytest
import torch

from kasoku.core.options import CompileOptions, InvalidOptions
from kasoku.core.weights import base_layers, bindable_tensors, run_time_weights
from kasoku.runtime.lora import LoraAdapter, LoraError, LoraLayer, LoraState, merged
from kasoku.tools.tiny import tiny_pipeline

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


@pytest.fixture(scope="module")
def peft_unet():
    """The tiny U-Net with two LoRA adapters injected by diffusers' PEFT integration (`b` on a 1x1 conv too)."""
    from peft import LoraConfig

    unet = tiny_pipeline().unet
    torch.manual_seed(0)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=ATTENTION, init_lora_weights=False), "a")
    unet.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["proj_in", "to_q"], init_lora_weights=False), "b")
    unet.set_adapters(["a", "b"], [0.5, 2.0])
    return unet


def test_peft_layers_bind_under_base_names_with_the_adapters_merged(peft_unet):
    plain = tiny_pipeline().unet
    tensors = bindable_tensors(peft_unet)
    assert set(tensors) == set(bindable_tensors(plain)) == {n for n, _ in plain.named_parameters()} | \
        {n for n, _ in plain.named_buffers()}
    layer = peft_unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    expected = layer.base_layer.weight + layer.get_delta_weight("a") + layer.get_delta_weight("b")
    torch.testing.assert_close(tensors["down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q.weight"],
                               expected, rtol=0, atol=0)
    with base_layers(peft_unet) as module:  # what the exporter sees: the base architecture
        assert not any(hasattr(m, "lora_A") for m in module.modules())
    assert any(hasattr(m, "lora_A") for m in peft_unet.modules())  # and restored afterwards


def test_disabled_adapters_bind_the_base_weights(peft_unet):
    peft_unet.disable_adapters()
    try:
        tensors = bindable_tensors(peft_unet)
    finally:
        peft_unet.enable_adapters()
    plain = bindable_tensors(tiny_pipeline().unet)
    assert all(torch.equal(tensors[name], plain[name]) for name in plain)


@pytest.mark.parametrize("kind", ["linear", "conv1x1", "conv3x3"])
def test_a_lora_layer_merges_as_peft_does(kind):
    from peft import LoraConfig, inject_adapter_in_model

    base = {"linear": torch.nn.Linear(12, 10), "conv1x1": torch.nn.Conv2d(12, 10, 1),
            "conv3x3": torch.nn.Conv2d(12, 10, 3)}[kind]
    model = torch.nn.Sequential(base)
    torch.manual_seed(1)
    inject_adapter_in_model(LoraConfig(r=3, lora_alpha=6, target_modules=["0"], init_lora_weights=False), model)
    layer = model[0]
    ours = LoraLayer(layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach(), 6 / 3)
    torch.testing.assert_close(ours.delta(base.weight.shape), layer.get_delta_weight("default").detach())


def test_merged_adds_each_adapter_at_its_weight_and_leaves_the_base_alone():
    base = {"w": torch.randn(6, 5), "v": torch.randn(6, 5)}
    kept = {n: t.clone() for n, t in base.items()}
    one = LoraAdapter("one", {"unet": {"w": LoraLayer(torch.randn(2, 5), torch.randn(6, 2), 0.5)}})
    two = LoraAdapter("two", {"unet": {"w": LoraLayer(torch.randn(1, 5), torch.randn(6, 1), 2.0),
                                       "v": LoraLayer(torch.randn(1, 5), torch.randn(6, 1), 1.0)}})
    out = merged(base, [(one, 0.3), (two, 1.5)], "unet", {"w"})
    assert set(out) == {"w"}  # only the names asked for
    want = base["w"] + 0.3 * 0.5 * (one.layers["unet"]["w"].up @ one.layers["unet"]["w"].down) + \
        1.5 * 2.0 * (two.layers["unet"]["w"].up @ two.layers["unet"]["w"].down)
    torch.testing.assert_close(out["w"], want)
    assert all(torch.equal(base[n], kept[n]) for n in base)


def test_adapter_state_follows_diffusers():
    a = LoraAdapter("a", {"unet": {"w": LoraLayer(torch.zeros(1, 2), torch.zeros(2, 1), 1.0)}})
    b = LoraAdapter("b", {"unet": {"w": LoraLayer(torch.zeros(1, 2), torch.zeros(2, 1), 1.0)},
                          "text_encoder": {"q": LoraLayer(torch.zeros(1, 2), torch.zeros(2, 1), 1.0)}})
    state = LoraState()
    state.add(a)
    state.add(b)
    assert state.active == ["b"]  # the latest loaded adapter is the active one
    state.set_active(["a", "b"], [0.5, {"unet": 2.0, "text_encoder": 0.0}])
    assert [(x.name, w) for x, w in state.contributions("unet")] == [("a", 0.5), ("b", 2.0)]
    assert [(x.name, w) for x, w in state.contributions("text_encoder")] == [("b", 0.0)]
    state.enabled = False
    assert state.contributions("unet") == []
    state.enabled = True
    state.fuse(["unet"], 0.5)
    state.delete(["a", "b"])
    assert [(x.name, w) for x, w in state.contributions("unet")] == [("a", 0.25), ("b", 1.0)]  # fused stay
    state.unfuse(["unet"])
    assert state.contributions("unet") == []
    with pytest.raises(LoraError, match="no adapter is named 'c'"):
        state.set_active(["c"], [None])


def test_lora_targets_option_and_run_time_weights():
    assert CompileOptions(lora_targets="attention").lora_targets == (
        "k_proj", "out_proj", "q_proj", "to_k", "to_out.0", "to_q", "to_v", "v_proj")
    assert CompileOptions(lora_targets="to_q, to_k").lora_targets == ("to_k", "to_q")
    with pytest.raises(InvalidOptions, match="`lora_targets` are module names"):
        CompileOptions(lora_targets="to q")
    names = ["unet.a.attn1.to_q.weight", "unet.a.attn1.to_q.bias", "unet.a.attn1.to_out.0.weight",
             "unet.proj_in.weight"]
    assert run_time_weights(names, ("to_q", "to_out.0")) == {"unet.a.attn1.to_q.weight",
                                                             "unet.a.attn1.to_out.0.weight"}
    assert run_time_weights(names, ()) == frozenset()


def test_cli_lora_spec_and_job_loras(tmp_path):
    from kasoku.batch.jobs import InvalidJobs, parse_job, read_jobs
    from kasoku.cli.base import lora_spec

    file = tmp_path / "style.safetensors"
    file.write_bytes(b"")
    assert lora_spec(f"{file}:0.8") == (file, 0.8)
    assert lora_spec(str(file)) == (file, 1.0)
    job = parse_job(json.dumps({"prompt": "a cat", "loras": [f"{file}:0.5", {"path": str(file), "scale": 2}]}), 1, "x")
    assert job.loras == ((str(file), 0.5), (str(file), 2.0))
    plain = parse_job(json.dumps({"prompt": "a cat"}), 1, "x")
    assert plain.key == parse_job(json.dumps({"prompt": "a cat", "loras": []}), 1, "x").key  # old keys hold
    assert job.key != plain.key and job.call_key != plain.call_key
    (tmp_path / "jobs.jsonl").write_text(json.dumps({"prompt": "a", "loras": [str(tmp_path / "missing")]}) + "\n"
                                         + json.dumps({"prompt": "b", "loras": "x"}) + "\n")
    with pytest.raises(InvalidJobs, match=r"(?s)jobs.jsonl:1: `loras`: .*missing does not exist.*jobs.jsonl:2: "
                                          r"`loras` must be a list"):
        read_jobs(tmp_path / "jobs.jsonl")


def test_a_pipeline_saved_and_loaded_back_keeps_its_architecture_key(tiny_dir):
    """transformers writes `architectures` and `dtype` into a saved config: the graph is the same, so is its key
    (else a folder and the pipeline it was saved from would export twice)."""
    from kasoku.model.loading import load_pipeline
    from kasoku.model.pipeline_model import component_specs

    folder = component_specs(load_pipeline(tiny_dir, lazy=True), None, ("text_encoder", "unet"))
    memory = component_specs(tiny_pipeline(), None, ("text_encoder", "unet"))
    assert {n: s.architecture for n, s in folder.items()} == {n: s.architecture for n, s in memory.items()}
