"""The deployment: the alert rules page on what they should (promtool), the dashboard's queries parse, the
compose files are valid for docker-compose 1.29 in each combination the docs give, and, where a Docker engine
runs or can be started, the whole path of scripts/compose_check.sh (images built, compose up, answers, a write
surviving SIGKILL, replicas following new generations, Prometheus scraping, a drained stop)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
PROMETHEUS = ROOT / "docker" / "prometheus"
COMPOSE_FILES = [["docker-compose.yml", "docker-compose.override.yml"], ["docker-compose.yml", "docker-compose.host.yml"],
                 ["docker-compose.yml", "docker-compose.override.yml", "docker-compose.gpu.yml"],
                 ["docker-compose.yml", "docker-compose.gpu.yml", "docker-compose.host.yml"]]
needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool (Debian's prometheus package) is not installed")


@needs_promtool
def test_the_alert_rules_fire_on_the_series_that_should_page_and_not_beside_them():
    done = subprocess.run(["promtool", "test", "rules", "alerts.test.yml"], cwd=PROMETHEUS, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {rule["alert"] for group in yaml.safe_load((PROMETHEUS / "alerts.yml").read_text())["groups"]
              for rule in group["rules"]}
    tested = {test["alertname"] for case in yaml.safe_load((PROMETHEUS / "alerts.test.yml").read_text())["tests"]
              for test in case["alert_rule_test"]}
    assert alerts == tested  # every rule has its test


@needs_promtool
@pytest.mark.parametrize("config", ["prometheus.yml", "prometheus-host.yml"])
def test_each_prometheus_config_is_valid(config):
    done = subprocess.run(["promtool", "check", "config", config], cwd=PROMETHEUS, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_query_of_the_grafana_dashboard_parses(tmp_path):
    dashboard = json.loads((ROOT / "docker" / "grafana" / "dense-search.json").read_text())
    queries = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    assert len(queries) >= 12
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:query{i}", "expr": query}
                                                         for i, query in enumerate(queries)]}]}
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump(rules))
    done = subprocess.run(["promtool", "check", "rules", "dashboard.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose (1.29) is not installed")
@pytest.mark.parametrize("files", COMPOSE_FILES, ids=["+".join(files) for files in COMPOSE_FILES])
def test_docker_compose_1_29_accepts_the_compose_files(files):
    flags = [flag for file in files for flag in ("-f", file)]
    done = subprocess.run(["docker-compose", *flags, "--profile", "replicas", "--profile", "writer", "config"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    services = yaml.safe_load(done.stdout)["services"]
    assert set(services) == {"index-builder", "search", "search-2", "writer", "prometheus"}
    replicas = [services[name] for name in ("search", "search-2")]
    assert all("indexes:/indexes:ro" in volume_specs(replica) for replica in replicas)
    assert "indexes:/indexes:rw" in volume_specs(services["writer"])
    if "docker-compose.host.yml" in files:
        assert {service.get("network_mode") for service in services.values()} == {"host"}
        assert not any(service.get("ports") for service in services.values())  # the host's network refuses them


def volume_specs(service: dict) -> set[str]:
    """A service's volumes as `source:target:ro|rw`, in 1.29's short form or v2's long one."""
    return {volume if isinstance(volume, str) else
            f"{volume['source']}:{volume['target']}:{'ro' if volume.get('read_only') else 'rw'}"
            for volume in service.get("volumes", [])}


def docker_engine() -> str | None:
    """Why the deployment cannot be run here, or None where it can: an engine answers, or root may start one."""
    if shutil.which("docker") is None:
        return "no docker client"
    if subprocess.run(["docker", "info"], capture_output=True, timeout=60).returncode == 0:
        return None
    if shutil.which("dockerd") is None or os.geteuid() != 0:
        return "no Docker engine runs, and none can be started here (dockerd as root)"
    return None


@pytest.mark.docker
def test_the_deployment_runs_end_to_end_with_compose():
    reason = docker_engine()
    if reason is not None:
        pytest.skip(reason)
    done = subprocess.run(["bash", "scripts/compose_check.sh"], cwd=ROOT, capture_output=True, text=True,
                          timeout=3600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.splitlines()[-1].startswith("compose check: every step passed")
