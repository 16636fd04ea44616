"""CI runs the README's two set-up commands as written (.ci/readme_command.py reads them from its code
blocks): the extraction finds each once, in order, and refuses a README that breaks that."""

from __future__ import annotations

import importlib.util
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("readme_command", ROOT / ".ci" / "readme_command.py")
assert _spec is not None and _spec.loader is not None
readme_command = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_command)


def test_both_commands_come_from_the_readme_and_ci_runs_them_in_order() -> None:
    readme = (ROOT / "README.md").read_text()
    main, tests = readme_command.command(readme, "main"), readme_command.command(readme, "test")
    assert f"```bash\n{main}\n```" in readme and f"```bash\n{tests}\n```" in readme
    words = shlex.split(main)
    config = words[words.index("--config") + 1]
    assert (ROOT / config).is_file() and "--compare" in words
    assert "pytest" in tests
    ci = (ROOT / ".ci" / "run").read_text()
    assert ci.index("readme_command.py main") < ci.index("readme_command.py test")
    assert ci.index('bash -euo pipefail -c "$MAIN_JOB"') < ci.index('bash -euo pipefail -c "$TESTS"')


@pytest.mark.parametrize("readme, message", [
    ("## Set up and run\n\n```bash\npython -m pytest -q\n```\n", "0 bash blocks with 'april-ext train'"),
    ("## Set up and run\n```bash\npython -m pytest -q\n```\n```bash\napril-ext train --compare\n```\n",
     "test command before the main job"),
    ("## Set up and run\n```bash\napril-ext train\n```\n```bash\npytest\n```\n```bash\npytest -x\n```\n",
     "2 bash blocks with 'pytest'"),
])
def test_a_readme_without_exactly_one_of_each_in_order_is_refused(readme: str, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        readme_command.command(readme, "main")
