"""`kasoku tune` and ``recipe="fastest"``: the tuner measures the compositions of speed-ups on the tiny SD 1.x
pipeline (fp32 and bf16 × no caching, DeepCache and TaylorSeer on OpenVINO), keeps a monotone Pareto front in the
cache, resumes what a budget left, and the recorded winner holds its bound on prompts it never saw."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

import kasoku
from kasoku.cli import main
from kasoku.core.components import ImageShape, ShapeProfile
from kasoku.core.options import CALIBRATION_PROMPTS, CompileOptions, InvalidOptions
from kasoku.core.parity import psnr
from kasoku.core.step_cache import DEEPCACHE
from kasoku.model.pipeline_model import Model
from kasoku.policies.recipes import NoTunedRecipe, Recipe, RecipeBook, Trial, TuneRecord, pareto_front
from kasoku.tools.tune import markdown, plot, tune

STEPS = 8
SIZE = 64
MIN_PSNR = 30.0  # below every caching setting's measured drift on the tiny model (36-58 dB), far below exact (inf)
FRESH_PROMPTS = CALIBRATION_PROMPTS[:2]  # the tuner judged on verify's fidelity prompts: these it never saw


# the tests of a whole tune (the tuner's unit tests below stay in `make test`)
A_TUNE = pytest.mark.slow(reason="a whole tune over precisions and step caching")


@pytest.fixture(scope="module")
def tuned(tiny_dir, tiny_cache):
    return tune(tiny_dir, backend="openvino", steps=STEPS, precisions=("fp32", "bf16"), min_psnr=MIN_PSNR,
                cache_dir=tiny_cache.root)


@A_TUNE
def test_front_is_monotone_and_dominates_every_other_trial(tuned):
    record = tuned.record
    measured = [t for t in record.trials if t.ok]
    assert len(measured) >= 6  # the reference and the five fp32 caching settings at least
    front = record.front
    assert any(t.recipe.is_reference and math.isinf(t.psnr_db) for t in front)  # exact is never beaten on fidelity
    for faster, slower in zip(front, front[1:]):
        assert faster.seconds <= slower.seconds and faster.psnr_db < slower.psnr_db
    for trial in measured:
        if trial not in front:
            assert any(f.seconds <= trial.seconds and f.psnr_db >= trial.psnr_db for f in front), trial.recipe.label
    for trial in measured:  # each is judged against the fp32 images, not itself
        assert trial.recipe.is_reference or 10.0 < trial.psnr_db < 100.0
    assert record.complete and tuned.left == 0
    saved = json.loads(RecipeBook(tuned.path.parent.parent).path(record.key).read_text())
    assert len(saved["trials"]) == len(record.trials)


@A_TUNE
def test_bf16_is_measured_or_said_to_be_impossible_here(tuned):
    bf16 = [t for t in tuned.record.trials if t.recipe.precision == "bf16"]
    assert bf16
    for trial in bf16:  # a CPU with AVX512-BF16/AMX measures it; one without says why, never a silent fp32
        assert trial.ok or "bf16" in trial.error


@A_TUNE
def test_winner_meets_min_psnr_on_fresh_prompts(tuned, tiny_pipe, tiny_cache):
    winner = tuned.winner
    fitting = [t for t in tuned.record.trials if t.ok and t.psnr_db >= MIN_PSNR]
    assert winner.seconds == min(t.seconds for t in fitting)
    fast = kasoku.compile(tiny_pipe, "openvino", recipe="fastest", min_psnr=MIN_PSNR, cache_dir=tiny_cache.root)
    assert fast.recipe.recipe == winner.recipe
    assert fast.compile_report.precisions["unet"] == winner.recipe.precision
    assert fast.compile_report.notes[0].startswith(f"recipe fastest at {MIN_PSNR:g} dB: {winner.recipe.label}")
    exact = ShapeProfile.exact(ImageShape(1, SIZE, SIZE), guidance=True, multiple=Model.of(tiny_pipe).pixel_multiple)
    reference = kasoku.compile(tiny_pipe, "openvino", profile=exact, cache_dir=tiny_cache.root)
    for seed, prompt in enumerate(FRESH_PROMPTS):
        kwargs = dict(num_inference_steps=STEPS, output_type="np", height=SIZE, width=SIZE)
        image = fast(prompt, generator=torch.Generator().manual_seed(seed), **kwargs).images
        assert (fast.last_step_cache is not None) == bool(winner.recipe.caching)  # the recipe's caching, unasked
        expected = reference(prompt, generator=torch.Generator().manual_seed(seed), **kwargs).images
        assert psnr(expected, image) >= MIN_PSNR
        # a call's own step caching replaces the recipe's
        own = fast(prompt, generator=torch.Generator().manual_seed(seed), cache_method="taylorseer", cache_interval=2,
                   **kwargs).images
        assert fast.last_step_cache.interval == 2 and own.shape == image.shape


@A_TUNE
def test_a_tuned_recipe_serves_other_shapes_within_its_bound(tuned, tiny_pipe, tiny_cache):
    """Tuned at one shape (exact-shape engines), the recipe serves two prompts and another size: its engines grow,
    and its precision and step caching still apply, within its bound of diffusers' fp32 image."""
    from kasoku.pipeline.kasoku_pipeline import EnginesGrow

    fast = kasoku.compile(tiny_pipe, "openvino", recipe="fastest", min_psnr=MIN_PSNR, cache_dir=tiny_cache.root)
    assert fast.profile.is_static
    calls = [dict(prompt=["a red car", "a blue boat"]), dict(prompt="a red car", height=SIZE // 2, width=SIZE // 2)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for call in calls:
            kwargs = dict(num_inference_steps=STEPS, output_type="np", generator=torch.Generator().manual_seed(0))
            image = fast(**call, **kwargs).images
            assert (fast.last_step_cache is not None) == bool(tuned.winner.recipe.caching)
            expected = tiny_pipe(**call, **{**kwargs, "generator": torch.Generator().manual_seed(0)}).images
            assert psnr(expected, image) >= MIN_PSNR, call
    assert [w for w in caught if issubclass(w.category, EnginesGrow)]
    assert fast.compile_report.precisions["unet"] == tuned.winner.recipe.precision
    assert any("the tuned shape runs on its exact-shape engines" in note for note in fast.compile_report.notes)
    # the tuned shape again: its exact-shape engines (from the cache), not the range engines grown since
    with pytest.warns(EnginesGrow, match=r"this call is the tuned shape .*its exact-shape engines again"):
        fast("a red car", num_inference_steps=STEPS, output_type="np", height=SIZE, width=SIZE)
    assert fast.profile.is_static


@A_TUNE
def test_a_stricter_bound_picks_a_slower_closer_recipe(tuned):
    loose, strict = tuned.record.winner(MIN_PSNR), tuned.record.winner(math.inf)
    assert strict.recipe.is_reference
    assert loose.seconds <= strict.seconds and loose.psnr_db <= strict.psnr_db


@A_TUNE
def test_a_budget_stops_after_the_reference_and_a_rerun_resumes(tuned, tiny_dir, tiny_cache):
    # another record (4 steps) over the engines the tuning at 8 built
    settings = dict(backend="openvino", steps=4, size=(SIZE, SIZE), precisions=("fp32",),
                    caching={DEEPCACHE: ({"cache_interval": 2},)}, cache_dir=tiny_cache.root)
    first = tune(tiny_dir, budget_s=1e-6, **settings)
    assert first.measured == 1 and first.left == 1 and not first.record.complete
    assert [t.recipe.is_reference for t in first.record.trials] == [True]
    second = tune(tiny_dir, **settings)
    assert (second.resumed, second.measured, second.left) == (1, 1, 0) and second.record.complete
    assert second.record.trials[0].seconds == first.record.trials[0].seconds  # read back, not measured again
    again = tune(tiny_dir, **settings)
    assert (again.resumed, again.measured) == (2, 0)


@A_TUNE
def test_table_and_chart(tuned, tmp_path):
    text = markdown(tuned)
    assert f"Winner at {MIN_PSNR:g} dB" in text and "★" in text and "reference" in text
    chart = plot(tuned, tmp_path / "front.png")
    assert chart.stat().st_size > 5000 and chart.read_bytes()[:4] == b"\x89PNG"


@A_TUNE
def test_cli_tune_resumes_then_generate_runs_the_winner(tuned, tiny_dir, tiny_cache, tmp_path, capsys):
    common = ["--backend", "openvino", "--cache-dir", str(tiny_cache.root)]
    assert main(["tune", str(tiny_dir), "--steps", str(STEPS), "--precisions", "fp32,bf16", "--min-psnr",
                 str(MIN_PSNR), "--chart", str(tmp_path / "c.png"), *common]) == 0
    out = capsys.readouterr().out
    assert f"resumed: {len(tuned.record.trials)} trial(s)" in out and (tmp_path / "c.png").is_file()
    assert main(["generate", str(tiny_dir), "a red car", "--recipe", "fastest", "--min-psnr", str(MIN_PSNR),
                 "--steps", str(STEPS), "-o", str(tmp_path / "car.png"), *common]) == 0
    out = capsys.readouterr().out
    assert "recipe fastest at" in out and (tmp_path / "car.png").is_file()


# ---- unit: the record, the front, the checks ------------------------------------------------------


def _trial(seconds, db, precision="fp32", interval=None):
    return Trial(Recipe.of(precision, {"cache_interval": interval} if interval else None), seconds, db, 0.9)


@pytest.mark.unit
def test_pareto_front_of_known_trials():
    reference = _trial(1.0, math.inf)
    a, b, c, d = _trial(0.4, 33.0, "int8", 3), _trial(0.5, 31.0, "int8", 5), _trial(0.6, 45.0, "bf16"), \
        _trial(0.3, 30.0, "int8", 5)
    failed = Trial(Recipe.of("bf16", {"cache_interval": 2}), error="cannot be built here")
    front = pareto_front([reference, a, b, c, d, failed])
    assert front == [d, a, c, reference]  # b is slower and further than a; the failed trial is no point
    record = TuneRecord(key="k", model="m", model_digest="0" * 64, machine={}, backend="auto", height=64, width=64,
                        guidance=7.5, guided=True, steps=8, prompts=["p"], trials=[reference, a, b, c, d, failed])
    assert record.winner(32.0) is a and record.winner(40.0) is c and record.winner(60.0) is reference
    back = TuneRecord.from_dict(json.loads(json.dumps(record.to_dict())))
    assert back.front == front and math.isinf(back.trials[0].psnr_db) and back.trials[-1].error


@pytest.mark.unit
def test_recipe_labels_and_call_arguments():
    recipe = Recipe.of("int8", {"cache_method": "taylorseer", "cache_interval": 3}, "/taesd")
    assert recipe.label == "int8 + taylorseer interval 3 + tiny VAE"
    assert recipe.call_arguments == {"cache_method": "taylorseer", "cache_interval": 3}
    assert Recipe.from_dict(recipe.to_dict()) == recipe and not recipe.is_reference
    assert Recipe.of("fp32", {"cache_threshold": 0.1}).label == "fp32 + first-block threshold 0.1"
    ranged = Recipe.of("bf16", {"cache_interval": 2}, exact_shape=False)
    assert ranged.label == "bf16 + caching interval 2 + range engines"


@pytest.mark.unit
def test_a_damaged_record_is_said_and_ignored(tmp_path):
    book = RecipeBook(tmp_path)
    book.folder.mkdir(parents=True)
    book.path("broken").write_text("{not json")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert book.load("broken") is None
    assert any("damaged" in str(w.message) for w in caught)


@pytest.mark.unit
def test_recipe_option_checks(tiny_pipe, tmp_path):
    with pytest.raises(InvalidOptions, match="recipe"):
        CompileOptions(recipe="quickest")
    with pytest.raises(InvalidOptions, match="both choose the precision"):
        CompileOptions(recipe="fastest", precision="fastest")
    with pytest.raises(InvalidOptions, match="leave `precision` out"):
        kasoku.compile(tiny_pipe, "openvino", recipe="fastest", precision="int8", cache_dir=tmp_path)
    with pytest.raises(NoTunedRecipe, match="kasoku tune"):  # said before anything is built
        kasoku.compile(tiny_pipe, "openvino", recipe="fastest", cache_dir=tmp_path)
    assert not (tmp_path / "entries").exists()


@pytest.mark.unit
@pytest.mark.parametrize("argv, message", [
    (["--budget-s", "0"], "--budget-s must be a positive"),
    (["--size", "60x64"], "positive multiple of"),
    (["--precisions", "fp32,fp8"], "precisions are among"),
    (["--steps", "0"], "positive"),
])
def test_cli_tune_refuses_bad_settings_before_any_work(tiny_dir, tmp_path, capsys, argv, message):
    code = None
    try:
        code = main(["tune", str(tiny_dir), "--cache-dir", str(tmp_path), *argv])
    except SystemExit as exit_:  # argparse's own refusals
        code = exit_.code
    assert code not in (0, None)
    captured = capsys.readouterr()
    assert message in captured.out + captured.err
    assert not (tmp_path / "entries").exists()
