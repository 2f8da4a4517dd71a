"""deploy/grafana/smb2.json: every query of the dashboard names only metrics
that a real ``smb2-server --metrics`` exports, and every smb2 metric it
exports is on the dashboard."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from smb2.testing.metrics import MetricsServer

# the soft-RoCE guest has no prometheus-client: the host runs these
text_string_to_metric_families = pytest.importorskip(
    "prometheus_client.parser", reason="smb2-server --metrics needs prometheus-client (pip install 'smb2[metrics]')"
).text_string_to_metric_families

DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "smb2.json"

# what a family of each type exposes (prometheus_client names a counter's
# family without its _total, an info family without its _info)
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "info": ("_info",),
            "gauge": ("",), "summary": ("", "_sum", "_count")}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
            "offset"}


def exported(text: str) -> dict[str, set[str]]:
    """A scrape's metric families, each with the names of its samples
    (also those a family with no sample yet will have)."""
    return {family.name: {family.name + s for s in SUFFIXES[family.type]} | {s.name for s in family.samples}
            for family in text_string_to_metric_families(text)}


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label names, functions,
    keywords, durations and variables are not)."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,\s*\w+\s*\)\s*", expr)
    if m:
        return {m[1]}
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)                # strings
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)             # label matchers, ranges
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\$\w+", " ", expr)                            # $instance, $__rate_interval
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", expr):
        if not m[2] and m[1] not in KEYWORDS:
            names.add(m[1])
    return names


def queries(node: Any) -> Iterator[str]:
    """Every PromQL string of the dashboard: panel targets and variables."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and "(" in value:
                yield value
            else:
                yield from queries(value)
    elif isinstance(node, list):
        for item in node:
            yield from queries(item)


def test_metric_names_parser() -> None:
    """The parser the check rests on finds the metrics, and only them."""
    assert metric_names('histogram_quantile(0.99, sum by (instance, op, le) '
                        '(rate(smb2_op_seconds_bucket{instance=~"$instance"}[$__rate_interval])))') \
        == {"smb2_op_seconds_bucket"}
    assert metric_names('(process_resident_memory_bytes{a="x"} - smb2_used_bytes) / ignoring (kind) '
                        'smb2_receive_memory_bytes{kind="limit"}') \
        == {"process_resident_memory_bytes", "smb2_used_bytes", "smb2_receive_memory_bytes"}
    assert metric_names("label_values(smb2_server_info, instance)") == {"smb2_server_info"}
    assert metric_names("rate(smb2_opz_total[5m]) > 0") == {"smb2_opz_total"}


@pytest.mark.server_process_only
def test_dashboard_queries_name_exported_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    server = MetricsServer("--capacity", "16MiB")
    try:
        with urllib.request.urlopen(server.url, timeout=10) as resp:
            families = exported(resp.read().decode())
    finally:
        server.stop()
    names = set().union(*families.values())
    assert {"smb2_ops_total", "smb2_op_seconds_bucket", "smb2_server_info",
            "process_resident_memory_bytes"} <= names, sorted(names)

    exprs = list(queries(dashboard))
    assert len(exprs) >= 20, exprs
    used: set[str] = set()
    for expr in exprs:
        read = metric_names(expr)
        assert read, f"a query that reads no metric: {expr}"
        assert read <= names, f"{sorted(read - names)} in {expr!r} are not exported by smb2-server"
        used |= read
    # the other way round: every smb2 metric the server exports is on a panel
    missing = [name for name, samples in families.items() if name.startswith("smb2_") and not samples & used]
    assert not missing, f"exported but on no panel: {sorted(missing)}"


def test_dashboard_panels_use_the_datasource_variable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert 'instance=~"$instance"' in target["expr"], (panel["title"], target["expr"])
