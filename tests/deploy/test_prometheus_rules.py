"""promtool (Debian's `prometheus` package; `make monitoring-tools` installs it) checks the scrape
config and the rules, and runs the rules' unit tests in deploy/prometheus/tests/. The dashboard's
queries go through promtool too, as recording rules of a scratch file, so the Prometheus that
runs them (not only our parser) accepts their syntax."""

import os
import shutil
import subprocess

import pytest
import yaml

from tests.deploy.promql import DEPLOY, RULE_FILES, dashboard_queries

PROMETHEUS = DEPLOY / "prometheus"


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("promtool is missing in CI: `make monitoring-tools` (a dependency of `make test`) installs "
                        "Debian's prometheus package")
        pytest.skip("promtool is not installed (run `make monitoring-tools`, or apt-get install prometheus)")
    return path


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_scrape_config_is_valid(promtool):
    result = run(promtool, "check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 rule files found" in result.stdout  # the config points at both rule files


def test_rules_are_valid(promtool):
    result = run(promtool, "check", "rules", *map(str, RULE_FILES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_rules_unit_tests_pass(promtool):
    tests = sorted(str(p) for p in (PROMETHEUS / "tests").glob("*.yml"))
    assert len(tests) >= 2
    result = run(promtool, "test", "rules", *tests)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("SUCCESS") == len(tests)


def test_every_alert_has_a_unit_test_that_fires_it(promtool):
    alerts = {rule["alert"] for group in yaml.safe_load((PROMETHEUS / "rules" / "alerts.yml").read_text())["groups"]
              for rule in group["rules"]}
    fired, quiet = set(), set()
    for path in (PROMETHEUS / "tests").glob("*.yml"):
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                (fired if case["exp_alerts"] else quiet).add(case["alertname"])
    assert alerts <= fired, f"never fired in a test: {sorted(alerts - fired)}"
    assert alerts <= quiet, f"never checked quiet in a test: {sorted(alerts - quiet)}"


def test_promtool_accepts_every_dashboard_query(promtool, tmp_path):
    exprs = [expr.replace("$__rate_interval", "1m") for _, expr in dashboard_queries()]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query_{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump(rules))
    result = run(promtool, "check", "rules", str(path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(exprs)} rules found" in result.stdout


def test_promtool_fails_a_broken_rule(promtool, tmp_path):
    """The checks above can fail: a rule with a syntax error is refused."""
    path = tmp_path / "broken.yml"
    path.write_text("groups:\n  - name: x\n    rules:\n      - record: job:x:rate5m\n        expr: sum(rate(x[5m])\n")
    assert run(promtool, "check", "rules", str(path)).returncode != 0
