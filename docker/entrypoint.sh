#!/usr/bin/env bash
# Entry point of the fork's serving image: say which fork build this is, then run the command.
set -e
python3 -m sglang.launch_server --version 2>/dev/null | head -n 1 >&2
exec "$@"
