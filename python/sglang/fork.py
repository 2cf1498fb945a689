"""What this engine is: sglang <upstream release> plus the fork's patch series.

The build stamps the version (``<release>+fork.<patches>.<series digest>``) and the series
(``_fork_manifest.json``) beside this module; ``--version``, ``sglang version``, the startup line
and ``--fork-expect-version`` read them here (docs/fork-identity.md). The fork flags are those
the patches' ``Server-Args:`` trailers list.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterable

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
    lines = [
        f"sglang {m['version']} (fork of sglang {m['upstream']}; {len(m['series'])} patch(es))"
    ]
    for patch in m["series"]:
        flags = " ".join(patch["server_args"]) or "(no flags)"
        lines.append(f"  {patch['name']}: {flags}")
    return "\n".join(lines)


class PrintVersion(argparse.Action):
    """``--version``: print ``describe()`` as it is (argparse's own action re-wraps it) and exit."""

    def __init__(self, option_strings, dest, **kwargs):
        kwargs.update(
            nargs=0, help="Print the fork version and its patch series, then exit."
        )
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(describe())
        parser.exit()


def place_fork_flags(
    parser: argparse.ArgumentParser, namespaces: Iterable[type]
) -> None:
    """Show each fork flag in ``--help`` after the upstream field its patch names (help order only)."""
    try:
        ours = {flag_field(f) for f in fork_flags()}
    except RuntimeError:  # an unassembled tree: no manifest, upstream's order
        return
    by_dest = {a.dest: a for a in parser._actions}
    for ns in namespaces:
        anchor = None
        for name in getattr(ns, "__struct_fields__", ()):
            if name not in ours:
                anchor = by_dest.get(name, anchor)
                continue
            action = by_dest.get(name)
            if action is None or anchor is None:
                continue
            for actions in (parser._actions, parser._optionals._group_actions):
                if action in actions and anchor in actions:
                    actions.remove(action)
                    actions.insert(actions.index(anchor) + 1, action)
            anchor = action  # the next fork flag of this namespace follows this one


def startup_line(view: Any) -> str:
    """One line with every fork flag and its value, read from a resolving view."""
    values = ", ".join(
        f"{flag}={getattr(view, flag_field(flag))}" for flag in fork_flags()
    )
    return f"sglang {fork_version()} fork flags: {values or '(none)'}"


def parsed_flag(server_args: Any, field: str, parse: Callable[[Any], Any]) -> Any:
    """A fork flag's value for its validator, parsed by ``parse`` (the field's type parser).

    A command-line value is the parser's output already and comes back equal. An
    ``Engine(...)`` keyword skips argparse: where parsing changes it ("ON" -> "on") the parsed
    value is declared, so the published record holds parsed values only and the objects
    built from it at model or scheduler construction never parse.
    """
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    raw = getattr(resolving_view(server_args), field)
    value = parse(raw)
    if type(value) is not type(raw) or value != raw:
        declare_resolution(server_args, "parsed_flag", **{field: value})
    return value


def parse_expected_version(value: str) -> str:
    """``type_parser`` of ``--fork-expect-version``: a fork version as ``--version`` prints it."""
    if not VERSION_RE.match(str(value)):
        raise argparse.ArgumentTypeError(
            f"--fork-expect-version {value!r} is not a fork version; accepted form: "
            "<upstream release>+fork.<patches>.<7 hex digits>, as printed by "
            "`python -m sglang.launch_server --version` (e.g. 0.5.23+fork.1.3f9a1c2)"
        )
    return value


if __name__ == "__main__":
    print(describe())
