"""The warp-specialized fp8 draft head (benchmark/dspark/draft_head_fp8_ws.py: a candidate, not in
the wheel).

CPU: every shipped configuration compiles for SM90 without a GPU (tools/sm90_compile.py), within
an SM's shared memory and without spills; the tool flags a kernel that does not. GPU (-m gpu):
its logits are the same bits as the one-warpgroup wgmma kernel's at every row count both serve,
and a row's bits do not depend on the row count up to 128 rows (the shipped configuration at 17
row counts, eager and replayed from a CUDA graph; every candidate configuration at 1, 33 and 128
rows), on the real shards and on a head whose last tile is partial; a doubled block scale changes
its tile's logits and no other.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmark" / "dspark"))
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
    assert {f"draft_head_fp8_ws N={n}" for n in (8, 16, 32, 64, 128)} <= names, names
    for r in rows:
        assert r["spill_bytes"] == 0 and r["shared_bytes"] <= 227 * 1024, r


def test_the_compile_check_flags_what_would_fail_on_the_gpu():
    import sm90_compile

    ok = {"kernel": "k", "shared_bytes": 1000, "registers": 90, "spill_bytes": 0}
    assert sm90_compile.problems(ok) == []
    assert sm90_compile.problems({**ok, "shared_bytes": 300 * 1024})
    assert sm90_compile.problems({**ok, "spill_bytes": 8})
    assert sm90_compile.problems({"kernel": "k", "error": "CompilationError: x"})
    assert sm90_compile.problems({**ok, "registers": None, "spill_bytes": None})


def _head(n, k=5120, seed=0):
    from sglang.kernels.ops.gemm.e4m3_to_bf16 import permute_k
    from sglang.kernels.ops.speculative.dspark import draft_head_fp8 as kern

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    q, s = kern.quantize_head_fp8(w)
    return permute_k(q), s


@pytest.mark.gpu
@pytest.mark.parametrize("n", [32320, 129280, 1000])
def test_gpu_same_bits_as_the_wgmma_kernel_and_row_invariant(n):
    import draft_head_fp8_ws as ws
    import tune_draft_head_fp8_ws as tune

    from sglang.kernels.ops.speculative.dspark import draft_head_fp8_wgmma as wg

    qp, s = _head(n)
    x = torch.randn(128, 5120, device="cuda").to(torch.bfloat16)
    ref = torch.cat(
        [wg.draft_head_fp8_logits_wgmma(x[i : i + 64].clone(), qp, s) for i in (0, 64)]
    )
    rows = (1, 2, 5, 8, 9, 17, 32, 33, 40, 63, 64, 65, 80, 96, 97, 127, 128)
    for m in rows:
        xm = x[:m].clone()
        # every candidate configuration at three row counts, the shipped one at all
        cfgs = [None] + (
            tune.candidates(ws.padded_rows(m)) if m in (1, 33, 128) else []
        )
        for cfg in cfgs:
            got = ws.draft_head_fp8_logits_ws(xm, qp, s, cfg=cfg)
            assert torch.equal(got, ref[:m]), (n, m, cfg, "eager")
        out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ws.draft_head_fp8_logits_ws(xm, qp, s, out=out)
        out.zero_()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, ref[:m].to(torch.bfloat16)), (n, m, "graph")
    # the check sees a wrong block scale in the one vocabulary tile it changes
    s_bad = s.clone()
    s_bad[n // 32 - 1, 7] *= 2
    got = ws.draft_head_fp8_logits_ws(x, qp, s_bad)
    assert not torch.equal(got, ref)
    lo, hi = (n // 32 - 1) * 32, n // 32 * 32
    assert not torch.equal(got[:, lo:hi], ref[:, lo:hi])
    assert torch.equal(got[:, :lo], ref[:, :lo]) and torch.equal(
        got[:, hi:], ref[:, hi:]
    )
