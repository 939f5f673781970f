"""A folder's configs read as JSON answer the family, size step and native size a loaded Model answers."""

from __future__ import annotations

import pytest

from kasoku.model.pipeline_model import Model
from kasoku.model.preview import ConfigPreview
from kasoku.tools.tiny import write_tiny_pipeline


@pytest.mark.parametrize("family", ["sd1", "sd2", "sdxl", "sd3", "flux"])
def test_a_preview_answers_what_the_loaded_model_answers(family, tmp_path):
    folder = write_tiny_pipeline(tmp_path / family, family=family)
    preview, model = ConfigPreview.of(folder), Model.load(folder, lazy=True)
    assert preview.family is model.family
    assert (preview.pixel_multiple, preview.native_size) == (model.pixel_multiple, model.native_size)


def test_no_preview_where_configs_alone_cannot_say(tmp_path):
    from kasoku.tools.tiny_families import tiny_family_pipeline

    tiny_family_pipeline("pixart-sigma").save_pretrained(tmp_path / "pixart")  # generic: its step is recorded
    assert ConfigPreview.of(tmp_path / "pixart") is None
    partial = write_tiny_pipeline(tmp_path / "partial")
    (partial / "vae" / "config.json").unlink()  # the Model's loading names the missing file
    assert ConfigPreview.of(partial) is None
    assert ConfigPreview.of(tmp_path / "missing") is None and ConfigPreview.of("org/model") is None
