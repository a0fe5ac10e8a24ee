"""What the run report's plots show: whole clocks under the staleness bars, one time axis."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shoal.launch.report import _load, plot_staleness, summarize

matplotlib = pytest.importorskip("matplotlib", reason="plots need the bench extra")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


@pytest.mark.parametrize("tables", [1, 2, 3])
def test_staleness_bars_sit_on_whole_clocks(tables):
    fig, ax = plt.subplots()
    try:
        plot_staleness(ax, {f"t{i}": np.array([5.0, 3.0, 1.0]) for i in range(tables)})
        fig.canvas.draw()
        centres = np.array([bar.get_x() + bar.get_width() / 2 for bar in ax.patches]).reshape(tables, 3)
        np.testing.assert_allclose(centres.mean(axis=0), [0, 1, 2], atol=1e-9)  # each group centred on its clock
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
    finally:
        plt.close(fig)


def test_logged_values_and_server_samples_share_the_jobs_clock(tmp_path):
    started = 1_000_000.0
    (tmp_path / "servers.json").write_text(json.dumps({"interval_s": 0.25, "started": started, "samples": [
        {"t": 0.5, "servers": {"0": {"stats": {"messages": 1, "bytes_in": 10, "bytes_out": 10}, "clocks": [0]}}},
        {"t": 17.26257324, "servers": {"0": {"stats": {"messages": 9, "bytes_in": 90, "bytes_out": 90},
                                             "clocks": [3]}}}]}))
    (tmp_path / "worker-0.json").write_text(json.dumps({"rank": 0, "clock": 3, "tables": {}, "log": [
        {"t": started + 4.0, "clock": 1, "values": {"loss": 0.5}}]}))
    workers, _ = _load(tmp_path)
    assert workers[0]["log"][0]["t"] == pytest.approx(4.0)  # not 0: seconds since the job started
    summary = summarize(tmp_path)
    assert summary["job_seconds"] == 17.3 and "samples" not in summary
