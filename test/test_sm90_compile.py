"""tools/sm90_compile.py: the Hopper (Gluon) kernels compiled for SM90 on a machine without a GPU.

Every kernel at the configurations its host wrapper picks compiles, within an SM's shared
memory and without spills; the check flags a kernel that would not.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "tools"))


def test_every_configuration_compiles_for_sm90_without_spills():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, str(REPO / "tools" / "sm90_compile.py"), "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(res.stdout[: res.stdout.rindex("]") + 1])
    names = {r["kernel"] for r in rows}
    assert {f"draft_head_fp8_wgmma N={n}" for n in (8, 16, 32, 64)} <= names, names
    assert any(n.startswith("wo_a_fp8_mid") for n in names), names
    import sm90_compile

    assert {r["kernel"]: sm90_compile.problems(r) for r in rows} == {
        r["kernel"]: [] for r in rows
    }


def test_the_compile_check_flags_what_would_fail_on_the_gpu():
    import sm90_compile

    ok = {"kernel": "k", "shared_bytes": 1000, "registers": 90, "spill_bytes": 0}
    assert sm90_compile.problems(ok) == []
    assert sm90_compile.problems({**ok, "shared_bytes": 300 * 1024})
    assert sm90_compile.problems({**ok, "spill_bytes": 8})
    assert sm90_compile.problems({"kernel": "k", "error": "CompilationError: x"})
    assert sm90_compile.problems({**ok, "registers": None, "spill_bytes": None})
