#!/usr/bin/env python3
"""Check a ``launch_server`` command's arguments on a CPU machine: ``tools/fork check -- ARGS``.

Runs with the interpreter that `make` installed the fork into (``.venv``) what a launch runs
before it touches a device: upstream's argument parser with the fork's fields and their type
parsers, then the resolution pipeline with its hooks and every fork validator, then
``check_server_args`` as ``Engine`` calls it. It prints the fork flags that would be on, with
their resolved values, or the refusal the server would print; it exits 0 when accepted, 1 when
refused, 2 when it could not check (the model's config unreadable here).

Invariants:
- Nothing here decides: a refusal is the server's own exception, raised by the same code.
- No device is touched. ``--device`` defaults to ``cuda`` (as upstream's resolution tests
  do), and binary modules that cannot load on a CPU machine (``sgl_kernel``, ``deep_gemm``,
  ``torchvision``) import as stand-ins (``tools/standins``) whose every call raises, so a check
  that would need one fails loud instead of passing through it.
- The model's ``config.json`` is read (``--model-path`` a local directory, or a Hugging Face id
  with network access); no weights are read.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

TOOLS = Path(__file__).resolve().parent


def _given(argv: list[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in argv)


def _defaults() -> dict:
    """Each server argument's default, as the parser would fill it."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return {a.dest: a.default for a in parser._actions}


def check(argv: list[str], out=sys.stdout) -> int:
    """Parse and resolve ``argv`` as ``launch_server`` would; print what is on or refused."""
    from sglang.fork import flag_field, fork_flags, fork_version
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.server_args import prepare_server_args

    if not _given(argv, "--device"):
        argv = [*argv, "--device", "cuda"]
    print(
        f"sglang {fork_version()}: checking on this machine, no device touched",
        file=out,
    )
    try:
        server_args = prepare_server_args(argv)
    except SystemExit as e:  # argparse printed the usage and the bad value on stderr
        if e.code == 0:  # --help, --version
            return 0
        print("refused: by the argument parser (its message is above)", file=out)
        return 1
    if not _given(argv, "--log-level"):
        logging.getLogger().setLevel(logging.WARNING)  # the startup INFO lines
    try:
        server_args.resolve_once()
        server_args.check_server_args()
    except (ValueError, TypeError) as e:
        print(f"refused: {e}", file=out)
        return 1
    except OSError as e:
        print(
            f"not checked: the model's config could not be read ({e.__class__.__name__}: "
            f"{str(e).splitlines()[0]}); pass --model-path a directory that holds its "
            "config.json (no weights needed), or a Hugging Face id with network access",
            file=out,
        )
        return 2
    except RuntimeError as e:  # a stand-in was called, or resolution failed
        print(f"not checked: {e}", file=out)
        return 2
    view, defaults = resolving_view(server_args), _defaults()
    on = [
        (flag, getattr(view, flag_field(flag)))
        for flag in fork_flags()
        if getattr(view, flag_field(flag)) != defaults.get(flag_field(flag))
    ]
    print("accepted: the resolution hooks and every fork validator passed", file=out)
    if on:
        print("fork flags on:", file=out)
        for flag, value in on:
            print(f"  {flag} {value}", file=out)
    else:
        print("fork flags on: none (upstream's code path)", file=out)
    print(
        f"fork flags off: {len(fork_flags()) - len(on)} (--version lists them)",
        file=out,
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(TOOLS / "standins"))
    return check(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
