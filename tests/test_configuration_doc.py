"""docs/configuration.md is generated from the code (scripts/configuration_doc.py) and must stay what the
script writes: every SEARCH_* setting and every flag of every CLI, each setting described in one sentence."""

from __future__ import annotations

import importlib.util
import re

import pytest

from service.settings import ServiceSettings
from tests.conftest import ROOT

SCRIPT = ROOT / "scripts" / "configuration_doc.py"
HEADING = re.compile(r"^#{2,3} `(.+)`$", re.MULTILINE)


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("configuration_doc", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sections(script) -> dict[str, str]:
    """The text under each `## `command`` / `### `command sub`` heading of the file on disk."""
    text = script.OUTPUT.read_text()
    parts = HEADING.split(text)
    return dict(zip(parts[1::2], parts[2::2]))


def test_configuration_md_is_what_the_script_writes_now(script):
    stale = script.difference()
    assert stale is None, (
        f"docs/configuration.md is out of date: run `python scripts/configuration_doc.py` and commit it\n{stale}")


def test_every_setting_is_in_the_reference_as_its_variable(script):
    text = script.OUTPUT.read_text()
    missing = [name for name in ServiceSettings.model_fields if f"| `SEARCH_{name.upper()}` |" not in text]
    assert missing == []


def test_every_flag_of_every_cli_is_in_its_commands_section(script, sections):
    missing = []
    for command, parser in script.cli_parsers():
        commands = [(command, parser)] + [(f"{command} {name}", sub) for name, _, sub in script.subcommands(parser)]
        for heading, each in commands:
            section = sections.get(heading, "")
            missing += [f"{heading}: {flag}" for action in each._actions for flag in action.option_strings
                        if flag not in ("-h", "--help") and not re.search(rf"`{re.escape(flag)}[ `,]", section)]
    assert missing == []


def test_index_builder_subcommands_and_service_with_ray_have_sections(sections):
    expected = {"python -m index_builder build", "python -m index_builder merge", "python -m index_builder eval",
                "python -m index_builder convert-cranfield", "python -m service", "python -m service --ray",
                "python -m training.split"}
    assert expected <= set(sections)


def test_every_training_cli_gives_its_parser_to_the_reference(script):
    # A training module with a parser of its own must expose it as build_parser(), or the reference misses it.
    with_parser = {path.stem for path in (ROOT / "training").glob("*.py") if "ArgumentParser(" in path.read_text()}
    covered = {command.removeprefix("python -m training.") for command, _ in script.cli_parsers()}
    assert with_parser - covered == set()


def test_each_setting_is_described_in_one_sentence_without_measurements():
    offenders = {}
    for name, field in ServiceSettings.model_fields.items():
        description = field.description or ""
        # e.g. and i.e. end no sentence; a full stop followed by a capital does.
        if not description.endswith(".") or re.search(r"\.\s+[A-Z]", description) or "bench/" in description:
            offenders[name] = description
    assert offenders == {}
