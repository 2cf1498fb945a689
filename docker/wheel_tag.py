"""Print the pinned upstream wheel tag this interpreter installs (the image's Python and platform).

The image's first stage runs it with the image's own python3, so the fork wheel is built for the
Python the image serves with: the first tag of ``upstream.toml``'s wheels that this interpreter
supports, in the interpreter's order of preference. No supported tag is an error naming them all.
    python3 docker/wheel_tag.py [UPSTREAM_TOML]
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

try:
    from packaging.tags import sys_tags
except ImportError:  # pip vendors packaging; an image has pip
    from pip._vendor.packaging.tags import sys_tags


def pick(pinned: list[str], supported: list[str]) -> str:
    """The first supported tag that upstream publishes a pinned wheel for."""
    for tag in supported:
        if tag in pinned:
            return tag
    raise SystemExit(
        f"no pinned upstream wheel for this Python ({supported[0]} ...): "
        f"upstream.toml pins {', '.join(pinned)}"
    )


def main(argv: list[str]) -> None:
    toml = (
        Path(argv[0]) if argv else Path(__file__).resolve().parents[1] / "upstream.toml"
    )
    pinned = list(tomllib.loads(toml.read_text())["upstream"]["wheels"])
    print(pick(pinned, [str(t) for t in sys_tags()]))


if __name__ == "__main__":
    main(sys.argv[1:])
