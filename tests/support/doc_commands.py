"""The shell commands of the docs' ```sh blocks, for tests that run or check them as written."""

from __future__ import annotations

import re
import shlex


def section(text: str, heading: str) -> str:
    """The text of a `## heading` section (its ### subsections included), up to the next ##."""
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def sh_blocks(text: str) -> list[str]:
    """Each ```sh block's text, as written."""
    return re.findall(r"```sh\n(.*?)```", text, re.S)


def commands(text: str) -> list[list[str]]:
    """The shell commands of the ```sh blocks, continuation lines joined, comments dropped."""
    found = []
    for block in sh_blocks(text):
        joined = re.sub(r"\\\n\s*", " ", block)
        for line in joined.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[-1] == "&":
                words.pop()
            if words:
                found.append(words)
    return found
