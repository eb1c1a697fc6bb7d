"""The second reliability probe's rows (benchmarks/reliability_probe.py --probe 2), fast ones: none may come back.

Each row is one input of shared/reviews/reliability-probe-2.md that was once a traceback, a silent wrong
answer, a hang or a loss of data; the script classifies what comes back by code, and here every row must
be ok or clear.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location("reliability_probe", Path(__file__).resolve().parent.parent / "benchmarks" / "reliability_probe.py")
probe = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(probe)


@pytest.mark.parametrize("group", list(probe.PROBE2))
def test_probe_2_rows_are_ok_or_clear(group, tmp_path, monkeypatch):
    monkeypatch.setattr(probe, "SCRATCH", tmp_path)
    probe.ROWS.clear()
    probe.PROBE2[group](fast=True)
    assert probe.ROWS, f"group {group} ran no rows"
    bad = [f"{r['row']} {r['input']}: {r['verdict']}: {r['got']}" for r in probe.ROWS if r["verdict"] not in ("ok", "clear")]
    assert not bad, "\n".join(bad)
