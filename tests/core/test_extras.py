"""ONNX Runtime is an extra the user chooses (kasoku[cpu] or kasoku[gpu]); no install set holds both
packages, and without either kasoku says which two extras to choose from."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from kasoku.core.extras import MissingOnnxRuntime, import_onnxruntime, ort_conflict

ROOT = Path(__file__).resolve().parents[2]
ORT = {"onnxruntime", "onnxruntime-gpu"}


def _names(requirements: list[str]) -> set[str]:
    return {re.split(r"[\s<>=!~\[;]", r, maxsplit=1)[0].lower().replace("_", "-") for r in requirements}


@pytest.fixture(scope="module")
def project() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_no_install_set_holds_both_onnxruntime_packages(project):
    core = _names(project["project"]["dependencies"])
    extras = {name: _names(reqs) for name, reqs in project["project"]["optional-dependencies"].items()}
    assert not core & ORT, "the core must leave ONNX Runtime to the cpu/gpu extras"
    assert extras["cpu"] & ORT == {"onnxruntime"} and extras["gpu"] & ORT == {"onnxruntime-gpu"}
    others = {name: deps for name, deps in extras.items() if name not in ("cpu", "gpu")}
    assert all(not deps & ORT for deps in others.values()), others
    # so the core plus cpu or gpu plus any of the other extras holds exactly one of the two
    for choice in ("cpu", "gpu"):
        assert len((core | extras[choice] | set().union(*others.values())) & ORT) == 1
    # and uv, which resolves extras together, is told they exclude each other
    assert [{"extra": "cpu"}, {"extra": "gpu"}] in project["tool"]["uv"]["conflicts"]


def test_make_setup_installs_one_onnxruntime_extra_and_pins_torch():
    makefile = (ROOT / "Makefile").read_text()
    install = next(line for line in makefile.splitlines() if "pip install" in line and "-e" in line)
    assert "$(ORT)" in install and "$(TORCH_PIN)" in install
    assert re.search(r"^ORT := cpu$", makefile, re.M)


def test_missing_onnxruntime_names_both_extras(monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # `import onnxruntime` raises ImportError
    with pytest.raises(MissingOnnxRuntime, match=r"kasoku\[cpu\].*kasoku\[gpu\].*not both"):
        import_onnxruntime()
    from kasoku.build.export import ort_session

    with pytest.raises(MissingOnnxRuntime, match="checks every ONNX export against torch"):
        ort_session(Path("model.onnx"))


def test_the_cli_without_onnxruntime_is_one_line_naming_both_extras(tiny_dir, tmp_path):
    """`import kasoku.build.compiler` needs no ONNX Runtime; `kasoku compile` then says what to install."""
    code = ("import sys; sys.modules['onnxruntime'] = None; import kasoku.build.compiler; from kasoku.cli import main; "
            f"raise SystemExit(main(['compile', {str(tiny_dir)!r}, '--backend', 'onnxruntime', "
            f"'--cache-dir', {str(tmp_path / 'cache')!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    assert done.returncode == 1 and len(lines) == 1, done.stdout + done.stderr
    assert "onnxruntime is not installed" in lines[0] and "kasoku[cpu]" in lines[0] and "kasoku[gpu]" in lines[0]
    assert not (tmp_path / "cache").exists()


def test_both_packages_installed_is_named_with_its_fix():
    assert ort_conflict(["onnxruntime"]) is None
    text = ort_conflict(["onnxruntime", "onnxruntime-gpu"])
    assert "only the CPU provider remains" in text and "pip uninstall -y onnxruntime onnxruntime-gpu" in text
