"""The CLI end to end on the tiny pipeline."""

from __future__ import annotations

import json

import pytest

from kasoku.cli import build_parser, main


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for name in build_parser()._subparsers._group_actions[0].choices:
        assert name in out


def test_demo_runs_end_to_end(tmp_path, capsys):
    assert main(["demo", "--workdir", str(tmp_path), "--json", str(tmp_path / "demo.json")]) == 0
    out = capsys.readouterr().out
    assert "FAILED" not in out and "PASSED" in out
    report = json.loads((tmp_path / "demo.json").read_text())
    parity = [p for c in report["export"]["components"] for p in c["parity"]]
    assert len(parity) >= 8 and all(p["passed"] for p in parity)
