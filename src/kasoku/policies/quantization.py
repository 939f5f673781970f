"""Which int8 recipe (kasoku.backends.int8) each component gets, where the options ask for one besides its spec's.

`CompileOptions.int8_activations` makes a component's int8 the calibrated one
(:func:`kasoku.policies.calibration.with_activations`); `CompileOptions.int4_weights` makes a weight-only component's
weights int4 (:func:`with_int4_weights`). Both are refused before any work where the compile does not build the
component in int8 (:func:`int8_components`).
"""

from __future__ import annotations

from dataclasses import replace

from ..backends.int8 import INT4_RECIPE
from ..core.components import ComponentSpec, Precision
from ..core.options import CompileOptions, InvalidOptions


def int8_components(option: str, specs: dict[str, ComponentSpec], options: CompileOptions) -> tuple[str, ...]:
    """The components `options.<option>` names, each checked to be built by this compile, in int8."""
    names = getattr(options, option)
    missing = [name for name in names if name not in specs]
    if missing:
        raise InvalidOptions(f"`{option}` names {', '.join(missing)}, which this compile does not build: it "
                             f"builds {', '.join(specs)}.")
    for name in names:
        precision = options.precision_of(name)
        if precision != Precision.INT8:
            raise InvalidOptions(f"`{option}` names {name}, whose precision is {precision.value}: only an int8 "
                                 f"engine has them. Compile {name} in int8 (precision 'int8', or int8 for it in a "
                                 f"mapping) or leave it out of `{option}`.")
    return names


def with_int4_weights(specs: dict[str, ComponentSpec], options: CompileOptions) -> dict[str, ComponentSpec]:
    """`specs` with the int8 recipe of each component `options.int4_weights` names made int4 weights (held to int8's
    contract like any int8 engine). Refused before any work for a component whose int8 quantizes its activations
    (a denoiser, or one named in `int8_activations`): int4 is a weight-only recipe."""
    chosen = dict(specs)
    for name in int8_components("int4_weights", specs, options):
        if specs[name].int8 != "weights":
            raise InvalidOptions(f"`int4_weights` names {name}, whose int8 quantizes its activations too "
                                 f"({specs[name].int8!r} recipe: a denoiser's, or `int8_activations`'): int4 is a "
                                 f"weight-only recipe, for the text encoders and other components in int8 weights. "
                                 f"Leave {name} out of `int4_weights` (or out of `int8_activations`).")
        chosen[name] = replace(specs[name], int8=INT4_RECIPE)
    return chosen
