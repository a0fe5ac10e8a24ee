"""Metrics and status of a running job: every process serves Prometheus metrics (on 127.0.0.1, or
guarded by a token derived from the job's secret), and ``shoal status`` finds the job and prints its
servers' live figures."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from shoal.api.errors import ConfigError
from shoal.client.worker import Worker
from shoal.cluster.exposition import FamilyCollector
from shoal.cluster.metrics import Family, LatencyHistogram, metrics_token
from shoal.cluster.metrics_endpoint import MetricsEndpoint
from tests.support.cluster import ThreadCluster

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "busy_worker.py"


def scrape(url: str, token: str | None = None) -> dict[str, list]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = response.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def total(samples, name: str, **labels) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_the_exposition_parses_with_the_prometheus_client_and_escapes_labels():
    hist = LatencyHistogram()
    for seconds in (2e-5, 3e-4, 3e-4, 7.0, 20.0):
        hist.observe("PULL", seconds)
    odd = Family("shoal_test_total", "counter", "A label with \"quotes\", a \\ and a\nnewline.")
    odd.add(3, table='we"ird\\na\nme')
    registry = CollectorRegistry(auto_describe=False)
    registry.register(FamilyCollector(lambda: [hist.family("lat", "h", "op"), odd], {"node": 3}))
    parsed = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    buckets = {s.labels["le"]: s.value for s in parsed["lat"].samples if s.name == "lat_bucket"}
    assert buckets["2.5e-05"] == 1 and buckets["0.0005"] == 3 and buckets["10.0"] == 4 and buckets["+Inf"] == 5
    assert parsed["shoal_test"].samples[0].labels == {"node": "3", "table": 'we"ird\\na\nme'}
    assert parsed["shoal_test"].samples[0].name == "shoal_test_total" and parsed["shoal_test"].type == "counter"


def test_open_metrics_bind_loopback_only():
    with pytest.raises(ConfigError, match="off loopback, only for a job with a shared secret"):
        MetricsEndpoint(lambda: [], host="0.0.0.0")
    endpoint = MetricsEndpoint(lambda: [Family("x", "gauge", "X.").add(1)])
    try:
        assert scrape(endpoint.url)["x"][0].value == 1
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(endpoint.url.replace("/metrics", "/other"), timeout=5)
    finally:
        endpoint.close()


def test_a_failing_scrape_answers_500_and_the_endpoint_keeps_serving():
    calls = []

    def families() -> list[Family]:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a counter went away")
        return [Family("x", "gauge", "X.").add(2)]

    endpoint = MetricsEndpoint(families)
    try:
        assert _status_of(endpoint.url) == 500
        assert scrape(endpoint.url)["x"][0].value == 2
    finally:
        endpoint.close()


def _status_of(url: str, token: str | None = None) -> int:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


def test_a_signed_jobs_metrics_need_the_token_derived_from_its_secret(tmp_path):
    secret = bytes(range(32))
    with ThreadCluster(nodes=1, secret=secret, metrics=True) as cluster:
        worker = Worker(cluster.spec, 0, 0, cluster.transport, metrics_port=0)
        try:
            urls = [worker.metrics.url, cluster.servers[0].metrics.url]
            token = metrics_token(secret)
            assert [_status_of(u) for u in urls] == [401, 401]  # no token
            assert [_status_of(u, metrics_token(b"another secret")) for u in urls] == [401, 401]
            assert [_status_of(u, token) for u in urls] == [200, 200]
        finally:
            worker.shutdown()
    (tmp_path / "secret").write_text(secret.hex())
    printed = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "metrics-token", "--secret-file",
                              str(tmp_path / "secret")], capture_output=True, text=True, timeout=60)
    assert printed.returncode == 0 and printed.stdout.strip() == token
    assert token != secret.hex() and secret.hex() not in printed.stdout  # the token does not carry the secret


def test_a_running_job_serves_metrics_and_shoal_status_shows_it(tmp_path):
    private = {**os.environ, "TMPDIR": str(tmp_path)}  # its own run files: other jobs on the machine are not seen
    private.pop("SHOAL_RENDEZVOUS", None)
    job = subprocess.Popen([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--workers-per-node", "1",
                            "--classic", "--", sys.executable, str(SCRIPT), str(tmp_path)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=private)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "ready").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=10)[0]
            time.sleep(0.1)
        time.sleep(1.0)
        status = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "status", "--watch", "0.5", "--count", "2"],
                                capture_output=True, text=True, timeout=60, env=private)
        assert status.returncode == 0, status.stderr
        table = status.stdout.split("\n\n")[-1]  # the second table has rates
        lines = table.splitlines()
        assert "2 server(s)" in lines[0] and "2 worker(s) registered" in lines[0], table
        rows = [line.split() for line in lines[2:4]]
        assert [r[0] for r in rows] == ["0", "1"], table
        assert all(float(r[4]) > 0 for r in rows), table  # messages per second while training runs
        urls = [r[-1] for r in rows]
        workers = [line.split("metrics ")[-1] for line in lines if line.startswith("worker ")]
        assert len(workers) == 2 and all(u.startswith("http://127.0.0.1:") for u in urls + workers), table

        run_file = next((tmp_path / f"shoal-runs-{os.getuid()}").glob("*.json"))
        secret = bytes.fromhex(Path(json.loads(run_file.read_text())["secret_file"]).read_text())
        token = metrics_token(secret)  # every job has a secret, so its metrics want the token
        assert _status_of(urls[0]) == 401
        server = scrape(urls[0], token)
        assert total(server["shoal_server_requests"], "shoal_server_requests_total", op="pull") > 0
        assert total(server["shoal_server_request_seconds"], "shoal_server_request_seconds_count", op="PULL") > 0
        assert total(server["shoal_server_cpu_seconds"], "shoal_server_cpu_seconds_total", activity="PULL") > 0
        assert total(server["shoal_server_bytes"], "shoal_server_bytes_total", direction="in") > 0
        assert server["shoal_server_clock"][1].value >= server["shoal_server_clock"][0].value  # fastest >= slowest
        worker = scrape(workers[0], token)
        assert total(worker["shoal_worker_requests"], "shoal_worker_requests_total", op="PULL") > 0
        assert total(worker["shoal_worker_request_seconds"], "shoal_worker_request_seconds_count", op="PULL") > 0
        assert total(worker["shoal_worker_read_staleness_clocks"], "shoal_worker_read_staleness_clocks_count",
                     table="busy") > 0
        assert worker["shoal_worker_clock"][0].value > 0
        assert worker["shoal_worker_requests_resent"][0].value >= 0
        resend_after = worker["shoal_worker_resend_timeout_seconds"]  # per server, and the rendezvous
        assert {s.labels["peer"] for s in resend_after} >= {"0", "1"} and all(0 < s.value <= 1 for s in resend_after)
    finally:
        (tmp_path / "stop").touch()
        output = job.communicate(timeout=60)[0]
    assert job.returncode == 0, output


def test_status_without_a_job_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "status"], capture_output=True, text=True,
                          timeout=30, env={k: v for k, v in os.environ.items() if k != "SHOAL_RENDEZVOUS"})
    assert done.returncode == 1 and "no running job found" in done.stderr


def test_status_names_the_job_when_several_run(tmp_path):
    """`shoal run` prints its cluster id; with two jobs running, `shoal status` lists both instead of
    showing whichever started last, and shows the one named by its id (or a unique start of it)."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("SHOAL_RENDEZVOUS", None)
    jobs, ids = [], []
    try:
        for n in range(2):
            (tmp_path / f"info{n}").mkdir()
            jobs.append(subprocess.Popen(
                [sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "1", "--", sys.executable,
                 str(ROOT / "tests" / "scripts" / "probe_worker.py"), str(tmp_path / f"info{n}"), "hang"],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env))
            first = jobs[-1].stderr.readline()
            match = re.match(r"shoal: job ([0-9a-f]+): 1 node\(s\) x 1 worker\(s\) running .*probe_worker.py .*; "
                             r"rendezvous tcp://127.0.0.1:\d+; watch it with: shoal status \1$", first)
            assert match, first
            ids.append(match[1])

        def status(*args: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "shoal.launch.cli", "status", *args], capture_output=True,
                                  text=True, timeout=60, env=env)

        both = status()
        assert both.returncode == 1 and "2 jobs are running; name one" in both.stderr, both.stderr
        assert all(i in both.stderr for i in ids) and "probe_worker.py" in both.stderr, both.stderr
        for cluster_id in ids:
            named = status(cluster_id[:6])
            assert named.returncode == 0, named.stderr
            assert named.stdout.startswith(f"cluster {cluster_id} "), named.stdout
        unknown = status("zz")
        assert unknown.returncode == 1 and "no running job has a cluster id starting with 'zz'" in unknown.stderr
    finally:
        for job in jobs:
            job.terminate()
            job.communicate(timeout=60)


def test_a_finished_run_writes_a_report_with_plots(tmp_path):
    report = tmp_path / "report"
    done = subprocess.run([sys.executable, "-m", "shoal.launch.cli", "run", "--nodes", "2", "--report", str(report),
                           "--", sys.executable, str(ROOT / "examples" / "mf" / "train.py"), "--quiet", "--epochs",
                           "3"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"run report in {report / 'report.html'}" in done.stderr
    summary = json.loads((report / "summary.json").read_text())
    assert summary["workers"] == 2 and set(summary["clocks"]) == {"0", "1"}
    assert 0.8 < summary["last_logged"]["test_rmse (rank 0)"] < 1.2
    assert summary["job_seconds"] > 0 and summary["job_seconds"] == round(summary["job_seconds"], 1)
    assert "samples" not in summary and set(summary["server_bytes"]) == {"0", "1"}
    assert set(summary["staleness_mean"]) == {"mf.users", "mf.items"}
    page = (report / "report.html").read_text()
    for image in ("metrics.png", "throughput.png", "staleness.png"):
        assert f'src="{image}"' in page
        assert (report / image).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
