import json

import pytest

import colab_memopt as cm
from colab_memopt.report import VERDICTS, merge_results, summary_table


def _report(peak, seconds, label="x"):
    return cm.MemoryReport(
        peak_bytes=peak, by_category={}, category_peaks={}, resident_bytes={}, by_phase={}, by_module={},
        step_seconds=seconds, device="cpu", method="test", label=label,
    )


def test_record_writes_the_schema(tmp_path):
    claim = cm.Claim(claim="X saves 50%", source="paper", measured="40%", verdict="partly holds")
    entry = cm.record(
        "00_demo", baseline=_report(1000, 1.0, "base"), optimized=_report(600, 1.5, "opt"),
        metrics={"a": 1, "nested": {"b": 2.5}}, claims=[claim, {"claim": "c", "source": "s", "measured": "m", "verdict": "holds"}],
        results_dir=tmp_path,
    )
    on_disk = json.loads((tmp_path / "00_demo.json").read_text())
    assert on_disk == entry
    assert set(entry) == {"device", "seconds", "baseline", "optimized", "saving_pct", "time_ratio", "metrics", "claims"}
    assert entry["baseline"] == {"label": "base", "peak_bytes": 1000, "step_seconds": 1.0}
    assert entry["saving_pct"] == pytest.approx(40.0) and entry["time_ratio"] == pytest.approx(1.5)
    assert entry["claims"][0] == {"claim": "X saves 50%", "source": "paper", "measured": "40%", "verdict": "partly holds"}


def test_record_without_results_dir_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    entry = cm.record("00_demo", baseline=_report(10, 1.0))
    assert entry["optimized"] is None and entry["saving_pct"] is None
    assert list(tmp_path.iterdir()) == []


def test_verdicts_are_checked():
    assert "holds" in VERDICTS
    with pytest.raises(ValueError, match="verdict must be one of"):
        cm.Claim(claim="c", source="s", measured="m", verdict="true")
    with pytest.raises(ValueError, match="must not be empty"):
        cm.Claim(claim="c", source="", measured="m", verdict="holds")


def test_metrics_must_be_json(tmp_path):
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        cm.record("00_demo", baseline=_report(10, 1.0), metrics={"bad": object()})


def test_merge_and_summary(tmp_path):
    cm.record("00_a", baseline=_report(2 * 2**20, 1.0), optimized=_report(2**20, 2.0), results_dir=tmp_path)
    cm.record("01_b", baseline=_report(2**20, 1.0), results_dir=tmp_path)
    merged = merge_results(tmp_path)
    assert set(merged) >= {"device", "torch", "notebooks"} and list(merged["notebooks"]) == ["00_a", "01_b"]
    assert merged["device"] == "cpu"
    table = summary_table(merged)
    assert "50.0%" in table and "2.00x" in table and "01_b" in table
