"""The b12x release the fork's b12x backends are written against, and their startup check.

b12x's plan / bind / run API changes between releases, so every b12x path refuses to start
unless the GPU is SM12x and ``b12x`` imports at exactly ``B12X_VERSION``, naming what it found;
``test/test_b12x_contract.py`` checks the signatures the fork calls against that release.
"""

from __future__ import annotations

import importlib
from typing import Optional

B12X_VERSION = "1.5.1"
B12X_WHEEL = "b12x-1.5.1-py3-none-any.whl"
B12X_WHEEL_SHA256 = "8731e23571d8d45db26d78e7699ec0b23e7ba20b52487adf8c1063c8d8b53a3d"


def found_device() -> tuple[Optional[tuple[int, int]], str]:
    """(compute capability, name) of the current CUDA device, (None, why) without one."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None, "no CUDA device"
        cap = torch.cuda.get_device_capability()
        return cap, f"{torch.cuda.get_device_name()} (SM{cap[0]}{cap[1]})"
    except Exception as e:  # a broken driver is a finding too
        return None, f"no usable CUDA device ({type(e).__name__}: {e})"


def found_b12x(api: str, attr: str) -> tuple[Optional[str], str]:
    """(installed version, what went wrong or "") for ``b12x.<api>``, its lazy attribute loaded."""
    from importlib import metadata

    try:
        version = metadata.version("b12x")
    except metadata.PackageNotFoundError:
        return None, "b12x is not installed"
    try:
        module = importlib.import_module(f"b12x.{api}")
        getattr(module, attr)
    except Exception as e:
        return (
            version,
            f"b12x {version} is installed but b12x.{api}.{attr} does not load ({type(e).__name__}: {e})",
        )
    return version, ""


def b12x_refusal(flag: str, api: str, attr: str) -> Optional[str]:
    """Why ``flag`` cannot run here (naming what was found), or None."""
    cap, device = found_device()
    problems = []
    if cap is None or cap[0] != 12:
        problems.append(
            f"device: {device}, b12x kernels need SM120/SM121 (RTX Blackwell, GB10)"
        )
    version, why = found_b12x(api, attr)
    if why:
        problems.append(why)
    elif version != B12X_VERSION:
        problems.append(
            f"b12x {version} is installed, the fork is written against b12x=={B12X_VERSION}"
        )
    if not problems:
        return None
    return (
        f"{flag} refused: "
        + "; ".join(problems)
        + f" (on an SM120/SM121 GPU: pip install b12x=={B12X_VERSION}; elsewhere drop {flag})"
    )


def require_b12x(flag: str, api: str, attr: str) -> None:
    msg = b12x_refusal(flag, api, attr)
    if msg is not None:
        raise ValueError(msg)
