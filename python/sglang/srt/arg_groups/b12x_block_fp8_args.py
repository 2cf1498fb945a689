"""Flag of the b12x block-fp8 linear (sglang/srt/layers/quantization/b12x_block_fp8.py).

Kept apart from the linear so that the ``exec`` fields can import it without importing the
quantization package.
"""

from __future__ import annotations

import argparse

FLAG = "--block-fp8-mxfp8-backend"
CHOICES = ("b12x",)


def parse_block_fp8_mxfp8_backend(value) -> str:
    """type_parser of the flag: one of CHOICES, or ArgumentTypeError listing them."""
    v = str(value).strip().lower()
    if v not in CHOICES:
        raise argparse.ArgumentTypeError(
            f"{FLAG} {value!r}: accepted: b12x (unset: upstream's resolver)"
        )
    return v
