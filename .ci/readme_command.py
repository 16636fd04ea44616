"""Prints one of the README's two set-up commands, read from its code blocks, so CI runs them as written.

    python3 .ci/readme_command.py main    # the main job's block ("april-ext train")
    python3 .ci/readme_command.py test    # the tests' block ("pytest")

Both come from the bash blocks of the README's "## Set up and run" section; each must be found exactly
once there, the main job's before the tests'.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

SECTION = "## Set up and run"
MARKERS = {"main": "april-ext train", "test": "pytest"}


def blocks(readme: str) -> list[str]:
    start = readme.index(SECTION)
    end = readme.find("\n## ", start + len(SECTION))
    section = readme[start:end if end >= 0 else len(readme)]
    return [b.strip() for b in re.findall(r"^```bash\n(.*?)^```", section, flags=re.S | re.M)]


def command(readme: str, which: str) -> str:
    found = {name: [i for i, b in enumerate(blocks(readme)) if marker in b] for name, marker in MARKERS.items()}
    for name, where in found.items():
        if len(where) != 1:
            raise SystemExit(f"README.md's {SECTION!r} has {len(where)} bash blocks with {MARKERS[name]!r}; "
                             f"CI needs exactly one")
    if found["main"][0] > found["test"][0]:
        raise SystemExit(f"README.md's {SECTION!r} gives the test command before the main job")
    return blocks(readme)[found[which][0]]


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in MARKERS:
        raise SystemExit(f"usage: {sys.argv[0]} {'|'.join(MARKERS)}")
    print(command((Path(__file__).resolve().parent.parent / "README.md").read_text(), sys.argv[1]))
