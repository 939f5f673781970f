"""The runtime layer: diffusers' own pipelines running on engines.

:class:`~kasoku.runtime.engine_pipelines.EnginePipelines` puts the architectures' stand-ins in place of the
torch modules under the family's diffusers pipelines, one per task; :mod:`.lora` rebinds the engines' weights
for LoRA adapters; :mod:`.image_prompts` loads IP-Adapters with diffusers' own loader and checks them.

May import: the core, architectures, families, model, backends and build.
"""
