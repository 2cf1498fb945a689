"""The fork's resolution step: check ``--fork-expect-version``, announce the fork.

Runs first in the resolution pipeline, called directly as upstream's non-overridable
steps are (not through ``run_hook``: a plugin must not replace the build check), so a
wrong fork build is refused before any model or device work, and the one startup line
that lists every fork flag and its value is logged once per launch.
"""

from __future__ import annotations

import logging
from typing import Any

from sglang.fork import fork_version, parse_expected_version, startup_line
from sglang.srt.arg_groups.overrides import resolving_view

logger = logging.getLogger(__name__)


def handle_fork(server_args: Any) -> None:
    cfg = resolving_view(server_args)
    expected = cfg.fork_expect_version
    if expected is not None:
        parse_expected_version(expected)
        if expected != fork_version():
            raise ValueError(
                f"--fork-expect-version {expected} but this engine is sglang "
                f"{fork_version()}; refusing to start another patch series than "
                "the one asked for (see `python -m sglang.launch_server --version`)"
            )
    logger.info(startup_line(cfg))
