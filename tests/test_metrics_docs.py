"""The metric table, its generated reference in docs/OBSERVABILITY.md, the dashboard and the alert rules;
the pure pieces of shardkit.metrics (labels, the starvation alarm and its diagnosis)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from shardkit import metrics

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "OBSERVABILITY.md"
BEGIN, END = "<!-- metrics reference: begin -->\n", "<!-- metrics reference: end -->"
pytest.importorskip("prometheus_client")


def registered_samples() -> set[str]:
    """Sample names the registry exposes (a histogram adds _bucket, _sum, _count)."""
    names = set()
    for family in metrics.registry().collect():
        names |= {family.name, f"{family.name}_total", f"{family.name}_bucket", f"{family.name}_sum",
                  f"{family.name}_count"}
    return names


def test_docs_reference_equals_the_generated_text():
    text = DOCS.read_text()
    assert BEGIN in text and END in text, f"{DOCS} lost its reference markers"
    documented = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert documented == metrics.markdown_reference(), (
        "docs/OBSERVABILITY.md is out of date: regenerate its reference with `python -m shardkit.metrics --markdown`")
    # ...and every metric of the registry is in it, under its exposed name.
    documented_names = set(re.findall(r"`(shardkit_\w+)`", documented))
    exposed = {family.name + ("_total" if family.type == "counter" else "") for family in metrics.registry().collect()}
    assert documented_names == exposed


def test_metric_names_follow_the_conventions():
    for spec in metrics.METRICS:
        assert spec.name.startswith("shardkit_"), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        assert not re.search(r"_(ms|milliseconds|kb|mb|gib|percent)(_|$)", spec.name), f"{spec.name}: not a base unit"
        assert set(spec.labels) <= {"stream", "shard_format", "rank", "reason", "operation", "cause", "worker"}, spec.name


def dashboard_expressions() -> list[str]:
    dashboard = json.loads((REPO / "docs" / "grafana" / "shardkit.json").read_text())
    assert dashboard["uid"] and dashboard["title"] and isinstance(dashboard["panels"], list)
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    expressions = []
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"} and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        expressions += [target["expr"] for target in panel["targets"]]
    return expressions


def test_every_dashboard_and_alert_expression_uses_registered_metrics():
    exposed = registered_samples()
    rules = (REPO / "docs" / "prometheus" / "alerts.yml").read_text()
    used = set()
    for expr in dashboard_expressions() + re.findall(r"expr: (?:>-\n)?((?:.+\n)+?)\s+for:", rules):
        names = set(re.findall(r"\bshardkit_\w+", expr))
        assert names, f"expression uses no shardkit metric: {expr}"
        assert names <= exposed, f"unknown metrics {sorted(names - exposed)} in {expr}"
        used |= names
    # Every section of the table shows up on the dashboard or in the alerts.
    specs = {metrics.SPECS.get(name) or metrics.SPECS.get(re.sub(r"_(bucket|sum|count)$", "", name)) for name in used}
    assert {spec.section for spec in specs if spec} == set(metrics.SECTION_TITLES)


def test_promtool_accepts_the_alert_rules():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    result = subprocess.run([promtool, "check", "rules", str(REPO / "docs" / "prometheus" / "alerts.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout


@pytest.mark.parametrize("url, label", [
    ("s3://AKIAKEY:s3cr3t@bucket/corpora/web", "web"),
    ("https://user:pw@host/data/?X-Amz-Signature=abc", "data"),
    ("s3://key:secret@bucket", "bucket"),
    ("/local/path/ds/", "ds"),
])
def test_stream_labels_hold_no_credentials(url, label):
    assert metrics.stream_label(url) == label


def test_starvation_alarm_waits_for_a_full_window_skips_the_first_step_and_fires_once():
    alarm = metrics.StarvationAlarm(window=3, threshold=0.5)
    assert not alarm.update(10.0, 10.0)  # step 1: waiting for the first shards is normal
    assert not alarm.update(0.9, 1.0) and not alarm.update(0.9, 1.0)  # window not full yet
    assert alarm.update(0.9, 1.0)
    assert alarm.fraction == pytest.approx(0.9)
    assert not alarm.update(0.9, 1.0)  # once per run
    quiet = metrics.StarvationAlarm(window=3, threshold=0.5)
    assert not any(quiet.update(w, 1.0) for w in (1.0, 0.1, 0.9, 0.2, 0.3))  # a time-weighted 0.4 at most


@pytest.mark.parametrize("download, decode, cause", [
    (8.0, 1.0, "downloads are behind"), (0.5, 6.0, "decoding is the bottleneck"), (0.1, 0.1, "too few loader workers")])
def test_likely_cause_reads_the_loader_counters(download, decode, cause):
    deltas = {"shardkit_loader_download_seconds_total": download, "shardkit_loader_decode_seconds_total": decode,
              "shardkit_loader_wait_seconds_total": 4.0, "shardkit_storage_retries_total": 2}
    text = metrics.likely_cause(deltas, num_workers=2)
    assert text.startswith(cause) and "--num-workers (now 2" in text


class Throttled(Exception):
    """Shaped like botocore's ClientError: the error code lives in `response`."""

    def __init__(self, code: str, status: int):
        super().__init__(f"An error occurred ({code})")
        self.response = {"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}


def test_storage_retries_are_counted_by_operation_and_cause():
    from shardkit.storage import RetryPolicy, retry_call

    failures = [Throttled("SlowDown", 503), ConnectionResetError(104, "reset by peer")]

    def flaky():
        if failures:
            raise failures.pop(0)
        return "ok"

    labels = [("read", "SlowDown"), ("read", "ConnectionResetError")]
    before = [metrics.value("shardkit_storage_retries_total", operation=o, cause=c) for o, c in labels]
    attempts = metrics.value("shardkit_storage_requests_total", operation="read")
    assert retry_call(flaky, url="memory://x/y", what="read", policy=RetryPolicy(initial_delay=0), sleep=lambda _: None) == "ok"
    after = [metrics.value("shardkit_storage_retries_total", operation=o, cause=c) for o, c in labels]
    assert [a - b for a, b in zip(after, before)] == [1, 1]
    assert metrics.value("shardkit_storage_requests_total", operation="read") - attempts == 3
