"""What this engine is: sglang <upstream release> plus the fork's patch series.

The fork's build (``tools/fork``) stamps the version into ``sglang/_version.py``
(``0.5.23+fork.<patches>.<series digest>``) and the series into
``_fork_manifest.json`` beside this module. ``launch_server --version``, the
startup line and ``--fork-expect-version`` read them from here, so a running
server always says which patches it carries and which fork flags are set.
"""

from __future__ import annotations

import argparse
import argparse
import functools
import json
import re
from pathlib import Path
from typing import Any

# 0.5.23+fork.1.3f9a1c2: upstream release, number of patches, 7 hex of the series digest.
VERSION_RE = re.compile(r"^\d+(?:\.\d+)+\+fork\.\d+\.[0-9a-f]{7}$")
MANIFEST = Path(__file__).with_name("_fork_manifest.json")


@functools.cache
def manifest() -> dict:
    try:
        return json.loads(MANIFEST.read_text())
    except FileNotFoundError:
        raise RuntimeError(
            f"{MANIFEST} is missing: this sglang tree was not assembled by the "
            "fork's tools/fork, so it cannot say which patches it carries"
        ) from None


def fork_version() -> str:
    return manifest()["version"]


def fork_flags() -> list[str]:
    """Every server argument the series adds, in series order (``--flag-name``)."""
    return [flag for patch in manifest()["series"] for flag in patch["server_args"]]


def flag_field(flag: str) -> str:
    """``--fork-expect-version`` -> ``fork_expect_version`` (fork flags keep the default CLI name)."""
    return flag[2:].replace("-", "_")


def describe() -> str:
    """The text of ``--version``: the fork, its upstream and its series with their flags."""
    m = manifest()
    lines = [f"sglang {m['version']} (fork of sglang {m['upstream']}; {len(m['series'])} patch(es))"]
    for patch in m["series"]:
        flags = " ".join(patch["server_args"]) or "(no flags)"
        lines.append(f"  {patch['name']}: {flags}")
    return "\n".join(lines)


class PrintVersion(argparse.Action):
    """``--version``: print ``describe()`` as it is (argparse's own action re-wraps it) and exit."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, help="print the fork version and its patch series, then exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe())
        parser.exit()


class PrintVersion(argparse.Action):
    """``--version``: print ``describe()`` as it is (argparse's own action re-wraps it) and exit."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(nargs=0, help="Print the fork version and its patch series, then exit.")
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe())
        parser.exit()


def startup_line(view: Any) -> str:
    """One line with every fork flag and its value, read from a resolving view."""
    values = ", ".join(f"{flag}={getattr(view, flag_field(flag))}" for flag in fork_flags())
    return f"sglang {fork_version()} fork flags: {values or '(none)'}"


def parse_expected_version(value: str) -> str:
    """``--fork-expect-version`` syntax: a fork version as ``--version`` prints it."""
    if not VERSION_RE.match(value):
        raise ValueError(
            f"--fork-expect-version {value!r} is not a fork version; accepted form: "
            "<upstream release>+fork.<patches>.<7 hex digits>, as printed by "
            "`python -m sglang.launch_server --version` (e.g. 0.5.23+fork.1.3f9a1c2)"
        )
    return value


if __name__ == "__main__":
    print(describe())
