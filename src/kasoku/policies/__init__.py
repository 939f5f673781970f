"""The policies layer: what runs before the builder and hands it data, so the builder never runs a pipeline.

:mod:`.calibration` records int8 calibration samples from the family's own runs, :mod:`.quantization` gives the
components the options name their int8 recipe (int8 activations, int4 weights), :mod:`.fastest` picks a
precision per component within an image-fidelity bound (measured by :mod:`.fidelity`), and :mod:`.recipes`
keeps the tuned recipes and resolves one into options.

May import: the core, architectures, families, model, backends, build and runtime.
"""
