"""Deployment files, checked without a Docker engine (tests/test_deployment.py runs them with one): the compose
files parse and wire the services, volumes, health checks and GPU reservation together, and the images'
command serves an index outside a container and passes the images' own health check."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from bench.ports import unclaimed_ports
from service.settings import ServiceSettings
from tests.conftest import ROOT

COMPOSE = ROOT / "docker-compose.yml"
OVERRIDES = {"ports": ROOT / "docker-compose.override.yml", "gpu": ROOT / "docker-compose.gpu.yml",
             "host": ROOT / "docker-compose.host.yml"}
DOCKERFILES = {"cpu": ROOT / "docker" / "Dockerfile.cpu", "gpu": ROOT / "docker" / "Dockerfile.gpu"}
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")
INSTANCES = ("search", "search-2", "writer")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())  # `<<` merge keys resolved, as compose resolves them


def merge(base: dict, override: dict) -> dict:
    """Compose's merge rules as far as the overrides use them: mappings merge, values replace."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def defaults(text: str) -> str:
    """`${VAR:-default}` with nothing set in the environment, as compose interpolates it."""
    return VARIABLE.sub(lambda match: match.group(2) or "", text)


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    found, current = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            current += line.rstrip()[:-1] + " "
            continue
        current = (current + line).strip()
        if current:
            keyword, _, arguments = current.partition(" ")
            found.append((keyword.upper(), arguments.strip()))
        current = ""
    return found


def instruction(path: Path, keyword: str) -> list[str]:
    return [arguments for name, arguments in instructions(path) if name == keyword]


def command(path: Path) -> list[str]:
    (cmd,) = instruction(path, "CMD")
    return json.loads(cmd)  # exec form


def healthcheck(path: Path) -> tuple[str, list[str]]:
    """(options, exec-form command) of the HEALTHCHECK."""
    (check,) = instruction(path, "HEALTHCHECK")
    options, _, cmd = check.partition(" CMD ")
    return options, json.loads(cmd)


def environment(path: Path) -> dict[str, str]:
    return dict(token.split("=", 1) for env in instruction(path, "ENV") for token in shlex.split(env))


def test_compose_builds_the_index_into_a_named_volume_then_serves_it_read_only_beside_one_writer():
    compose = load(COMPOSE)
    assert set(compose["services"]) == {"index-builder", *INSTANCES, "prometheus"}
    assert "indexes" in compose["volumes"]
    builder, search = compose["services"]["index-builder"], compose["services"]["search"]
    assert builder["command"][:4] == ["python", "-m", "index_builder", "build"]
    arguments = builder["command"][4:]
    out = defaults(arguments[arguments.index("--out") + 1])
    assert out == "/indexes/main" and "--if-missing" in arguments
    assert "indexes:/indexes" in builder["volumes"]
    corpus_mount = next(v for v in builder["volumes"] if ":/corpus" in v)
    assert defaults(corpus_mount) == "./data/demo:/corpus:ro"
    assert (ROOT / "data" / "demo" / defaults(arguments[arguments.index("--corpus") + 1]).split("/")[-1]).is_file()
    ports = set()
    for name in INSTANCES:
        instance = compose["services"][name]
        assert instance["depends_on"] == {"index-builder": {"condition": "service_completed_successfully"}}
        assert defaults(instance["environment"]["SEARCH_INDEX_DIR"]) == out
        assert instance["environment"]["SEARCH_INDEX_ROOT"] == "/indexes"
        assert instance["image"] == builder["image"] and "build" not in instance
        port = instance["environment"]["SEARCH_PORT"]
        assert "ports" not in instance  # published by the default override, refused on the host's network
        published = load(OVERRIDES["ports"])["services"][name]["ports"]
        assert [defaults(p) for p in published] == [f"{port}:{8000 if name == 'search' else port}"]
        ports.add(port)
        writes = instance["environment"].get("SEARCH_WRITES") == "true"
        assert ("indexes:/indexes:ro" in instance["volumes"]) != writes, name  # only the writer writes
        assert writes == (name == "writer")
    assert len(ports) == len(INSTANCES)  # one port each, so they share the host's network too
    assert (ROOT / builder["build"]["context"] / builder["build"]["dockerfile"]) == DOCKERFILES["cpu"]


def test_the_gpu_override_reserves_every_gpu_for_the_builder_and_each_instance():
    compose, override = load(COMPOSE), load(OVERRIDES["gpu"])
    for name in ("index-builder", *INSTANCES):
        assert "deploy" not in compose["services"][name]
        gpu = merge(compose["services"][name], override["services"][name])
        (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
        assert device == {"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}, name
        assert defaults(gpu["image"]) == "dense-search:gpu"
    build = override["services"]["index-builder"]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]) == DOCKERFILES["gpu"]


def test_the_host_override_puts_every_container_and_build_on_the_hosts_network():
    compose, override = load(COMPOSE), load(OVERRIDES["host"])
    for name in compose["services"]:
        assert override["services"][name]["network_mode"] == "host", name
    assert override["services"]["index-builder"]["build"]["network"] == "host"


def test_instances_are_checked_by_the_images_check_of_ready():
    services = load(COMPOSE)["services"]
    _, image_check = healthcheck(DOCKERFILES["cpu"])
    assert "/ready" in image_check[-1]
    assert all("healthcheck" not in services[name] for name in INSTANCES)  # the image's own
    assert services["index-builder"]["healthcheck"] == {"disable": True}


def test_every_service_setting_can_reach_the_instances():
    services = load(COMPOSE)["services"]
    given = set(services["search"]["environment"]) | set(services["writer"]["environment"])
    fixed_by_the_image = {"SEARCH_HOST"}
    missing = {f"SEARCH_{name.upper()}" for name in ServiceSettings.model_fields} - fixed_by_the_image - given
    assert not missing, f"pass {sorted(missing)} through in x-search-environment (docker-compose.yml)"


def test_every_compose_variable_is_documented_in_the_deployment_page():
    readme = (ROOT / "docs" / "deployment.md").read_text()
    variables = {match.group(1) for path in (COMPOSE, *OVERRIDES.values()) for match in VARIABLE.finditer(path.read_text())}
    assert variables
    assert [v for v in sorted(variables) if f"`{v}`" not in readme] == []


def test_images_run_as_a_user_with_model_and_index_volumes_and_check_ready():
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    for kind, path in DOCKERFILES.items():
        user = instruction(path, "USER")
        assert user and user[-1] not in ("root", "0"), kind
        assert {"/models", "/indexes"} <= set(json.loads(instruction(path, "VOLUME")[0])), kind
        options, check = healthcheck(path)
        assert "--start-period" in options and "/ready" in check[-1], kind
        assert environment(path)["SEARCH_HOST"] == "0.0.0.0", kind
        for copy in instruction(path, "COPY"):
            if copy.startswith("--from="):
                continue  # from a build stage
            for source in copy.split()[:-1]:
                assert (ROOT / source).exists() and source not in ignored, (kind, source)
        assert any("apt-get install" in run and "libjemalloc2" in run for run in instruction(path, "RUN")), kind
    # The dependencies in a stage of their own, so that a change to the sources alone keeps their layers.
    assert instruction(DOCKERFILES["cpu"], "FROM") == [
        "${BASE_IMAGE} AS requirements", "${BASE_IMAGE} AS dependencies", "dependencies AS venv",
        "${BASE_IMAGE} AS sources", "dependencies AS project", "${BASE_IMAGE}"]
    assert {"BASE_IMAGE=python:3.11-slim", "WHEELS=index", "TORCH_INDEX=https://download.pytorch.org/whl/cpu"} <= set(
        instruction(DOCKERFILES["cpu"], "ARG"))
    assert any(arg.startswith("CUDA_IMAGE=nvidia/cuda:") for arg in instruction(DOCKERFILES["gpu"], "ARG"))
    assert any('".[gpu,tracing]"' in run and "uninstall -y faiss-cpu" in run for run in instruction(DOCKERFILES["gpu"], "RUN"))


def test_the_images_command_serves_an_index_and_passes_the_images_health_check(small_index):
    cpu, gpu = DOCKERFILES["cpu"], DOCKERFILES["gpu"]
    assert command(cpu) == command(gpu) == ["python", "-m", "service"]  # the README's entry point
    assert healthcheck(cpu) == healthcheck(gpu)
    # "python" in the image is the interpreter the project is installed into: here, this one.
    argv = [sys.executable, *command(cpu)[1:]]
    _, check = healthcheck(cpu)
    check = [sys.executable, *check[1:]]
    env = {
        **os.environ,
        **environment(cpu),
        "SEARCH_INDEX_DIR": str(small_index),
        "SEARCH_INDEX_ROOT": str(small_index.parent),
        "SEARCH_HOST": "127.0.0.1",
        "SEARCH_PORT": str(unclaimed_ports(1)[0]),
        "SEARCH_DEVICE": "cpu",
    }
    server = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while subprocess.run(check, env=env, capture_output=True).returncode != 0:
            assert server.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "not ready within 90 s"
            time.sleep(0.5)
        base = f"http://127.0.0.1:{env['SEARCH_PORT']}"
        response = httpx.post(f"{base}/search", json={"query": "join two paths", "k": 2}, timeout=30)
        assert response.status_code == 200 and len(response.json()["results"]) == 2
    finally:
        server.terminate()
        output = server.communicate(timeout=30)[0]
    assert f"index_dir={small_index}" in output
    assert subprocess.run(check, env=env, capture_output=True).returncode == 1  # nothing serves now
