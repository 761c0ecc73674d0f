"""The shipped alert rules: promtool accepts them and their unit tests pass.

``deploy/prometheus/ouroboros-rules.yml`` is what an operator loads; its unit tests
(``ouroboros-rules.test.yml``) give each alert series under which it fires and
series under which it must not, evaluated by Debian's ``promtool`` (installed by
scripts/setup.sh with the prometheus package). The rules may only name metrics the
web process exports, so a renamed metric cannot leave an alert silently empty.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

# Full tier: promtool runs as a process.
pytestmark = pytest.mark.full

RULES = Path(__file__).resolve().parent.parent / "deploy" / "prometheus"
METRICS = Path(__file__).resolve().parent.parent / "scheduler" / "web" / "metrics.py"
# Series Prometheus itself makes for every target.
PROMETHEUS_SERIES = {"up"}


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed: run scripts/setup.sh"
    return subprocess.run(
        [binary, *args], cwd=RULES, capture_output=True, text=True, timeout=120, check=False
    )


def test_promtool_accepts_the_rules() -> None:
    checked = promtool("check", "rules", "ouroboros-rules.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 7 rules found" in checked.stdout


def test_every_alert_fires_and_holds_in_promtool_test_rules() -> None:
    tested = promtool("test", "rules", "ouroboros-rules.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    rules = yaml.safe_load((RULES / "ouroboros-rules.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    cases = yaml.safe_load((RULES / "ouroboros-rules.test.yml").read_text())["tests"]
    checks = [check for case in cases for check in case["alert_rule_test"]]
    for alert in alerts:
        mine = [check for check in checks if check["alertname"] == alert]
        assert any(check["exp_alerts"] for check in mine), f"{alert} is never seen firing"
        assert any(not check["exp_alerts"] for check in mine), f"{alert} is never seen quiet"


def test_the_rules_name_only_exported_metrics() -> None:
    rules = yaml.safe_load((RULES / "ouroboros-rules.yml").read_text())
    exported = set(re.findall(r'"(ouroboros_[a-z_]+)"', METRICS.read_text()))
    for group in rules["groups"]:
        for rule in group["rules"]:
            named = set(re.findall(r"\b(ouroboros_[a-z_]+|up)\b", rule["expr"]))
            # Counters are exported with the _total suffix of the family's name.
            unknown = {n for n in named if n.removesuffix("_total") not in exported}
            assert not unknown - PROMETHEUS_SERIES, (rule["alert"], unknown)


def test_a_broken_rule_is_refused(tmp_path: Path) -> None:
    """The check is no formality: promtool refuses a rule whose expression does not parse."""
    broken = tmp_path / "broken.yml"
    broken.write_text(
        "groups:\n  - name: x\n    rules:\n"
        "      - alert: Broken\n        expr: ouroboros_broker_up ==\n"
    )
    checked = promtool("check", "rules", str(broken))
    assert checked.returncode != 0
