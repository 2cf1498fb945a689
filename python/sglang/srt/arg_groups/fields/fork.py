"""Config fields of the ``fork`` namespace: flags about the fork itself.

How the fork declares a flag (every patch of the series follows this):

* A feature's flag lives in the upstream namespace that owns its area
  (``spec`` for DSpark, ``exec`` for kernels, ...) and is named as an
  upstream pull request would name it, so the patch is self-contained and can
  be sent upstream as it is. Only flags about the fork as a whole live here.
* Off by default: with every fork flag at its default the engine runs
  upstream's code path. The help text ends with ``(default: ...)``.
* Syntax is checked by a ``type_parser`` that raises with the accepted forms
  (an argparse error at the command line); the same check and every rule that
  involves other flags run again in the namespace's resolution hook, because
  ``Engine(...)`` builds ServerArgs without argparse.
* The patch's ``Server-Args:`` trailer lists the flag; that is how
  ``--version`` and the startup line (``sglang.fork``) find it.
"""

from __future__ import annotations

import argparse
from typing import Optional

import msgspec

from sglang.fork import parse_expected_version
from sglang.srt.arg_groups.arg_utils import A, Arg


def _expected_version_arg(value: str) -> str:
    try:
        return parse_expected_version(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Fork(msgspec.Struct):
    """Namespace ``fork``."""

    _NS_PATH = "fork"

    fork_expect_version: A[
        Optional[str],
        Arg(
            help="Refuse to start unless this engine is exactly this fork build, "
            "e.g. 0.5.23+fork.1.3f9a1c2 as printed by --version: guards a "
            "deployment against running another patch series than the one it "
            "was validated with. (default: unset, no check)",
            type_parser=_expected_version_arg,
        ),
    ] = None
