#!/usr/bin/env python3
"""Compile the fork's Hopper (Gluon) kernels for SM90 on a machine without a GPU.

    .venv/bin/python tools/sm90_compile.py [--json]

Triton compiles for a target it is told, so a stand-in driver that names SM90 (and launches
nothing) lets a CPU machine run each kernel's whole pipeline down to the cubin through ptxas.
Each kernel is compiled through its own host wrapper, its launch turned into a compile, at the
configurations the wrapper picks (``kernels``: the draft head at every wgmma N it ships, the
wo_a twin across its row ranges at G = 2 and 8). For each it reports the shared memory and
the cubin's registers and spills (cuobjdump), and fails (exit 1) where a kernel does not compile, takes more
shared memory than an H200 SM gives one CTA, or spills. It catches what a layout or pipeline
edit breaks before GPU time is spent; whether a kernel is right and fast is only known on the
GPU (its tests and benchmarks).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

SMEM_LIMIT = 227 * 1024  # shared memory an H100 / H200 SM gives one CTA
K = 5120  # the draft head's hidden size (DeepSeek-V4.1-Flash)
N = 32320  # the TP4 shard of its head
WO_A_R = 1024  # wo_a's rows per output group
WO_A_GROUPS = (2, 8)  # V4.1-Flash's output groups per rank at TP4 and TP1
H200_SMS = 132


class _Sm90Driver:
    """Triton's active driver for compiling only: the target is SM90, nothing is launched."""

    backend = "cuda"

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        import torch

        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


@contextlib.contextmanager
def _compile_only(wo_a_module):
    """While open: Triton's active driver names SM90, every launch compiles and returns its
    kernel without running it (``compiled`` collects them), and the wo_a wrappers size their
    grids for an H200's SMs. Restored on exit (the driver: on a GPU machine only)."""
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    compiled: list = []
    launch, sm_count = JITFunction.run, wo_a_module._sm_count

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append(kernel)
        return kernel

    driver.set_active(_Sm90Driver())
    JITFunction.run = compile_only
    wo_a_module._sm_count = lambda device: H200_SMS
    try:
        yield compiled
    finally:
        JITFunction.run, wo_a_module._sm_count = launch, sm_count
        try:
            driver.reset_active()
        except RuntimeError:  # no driver on a CPU machine: nothing to go back to
            pass


@functools.cache  # the same zero operands serve every configuration
def _draft_head_inputs(rows: int):
    import torch
    import triton

    x = torch.zeros(rows, K, dtype=torch.bfloat16)
    qp = torch.zeros(N, K, dtype=torch.float8_e4m3fn)
    return x, qp, torch.zeros(triton.cdiv(N, 32), K // 32)


@functools.cache
def _wo_a_inputs(rows: int, g: int):
    import torch

    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as wo

    packed = wo.pack_twin(torch.zeros(g, WO_A_R, wo.D, dtype=torch.float8_e4m3fn))
    exp = torch.zeros(g, WO_A_R // 32, wo.D // 32, dtype=torch.uint8)
    return torch.zeros(rows, g, wo.D, dtype=torch.bfloat16), packed, exp


def kernels() -> dict[str, object]:
    """{name: a call of a host wrapper}: each Hopper kernel at each configuration it ships."""
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as wo
    from sglang.kernels.ops.speculative.dspark import draft_head_fp8_wgmma as wg

    out = {}
    for np_ in wg.CONFIGS:
        out[f"draft_head_fp8_wgmma N={np_}"] = lambda np_=np_: (
            wg.draft_head_fp8_logits_wgmma(*_draft_head_inputs(np_))
        )
    for g in WO_A_GROUPS:
        for rows in (2, 8, 16, 64):
            out[f"wo_a_fp8_small G={g} rows={rows}"] = lambda g=g, rows=rows: (
                wo.wo_a_fp8_small_sm90(*_wo_a_inputs(rows, g))
            )
        for rows in (9, 32, 64, 128, 192):
            out[f"wo_a_fp8_mid G={g} rows={rows}"] = lambda g=g, rows=rows: (
                wo.wo_a_fp8_mid_sm90(
                    *_wo_a_inputs(rows, g), wo.mid_counters(g, WO_A_R, "cpu")
                )
            )
    return out


def cubin_usage(cubin: bytes) -> dict:
    """Registers, stack and local (spilled) bytes of the cubin Triton built, by cuobjdump."""
    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = Path(get_ptxas(90).path).with_name("cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "k.cubin"
        path.write_bytes(cubin)
        text = subprocess.run(
            [str(cuobjdump), "-res-usage", str(path)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    usage = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", text)
    if usage is None:
        return {"registers": None, "spill_bytes": None}
    regs, stack, local = map(int, usage.groups())
    return {"registers": regs, "spill_bytes": stack + local}


def compile_all() -> list[dict]:
    from sglang.kernels.ops.gemm import dsv4_wo_a_fp8_sm90 as wo

    rows = []
    with _compile_only(wo) as compiled:
        for name, build in kernels().items():
            row = {"kernel": name}
            try:
                compiled.clear()
                build()
                if len(compiled) != 1:
                    raise RuntimeError(f"{len(compiled)} launches, expected one")
                row["shared_bytes"] = compiled[0].metadata.shared
                row.update(cubin_usage(compiled[0].asm["cubin"]))
            except Exception as e:  # noqa: BLE001 (reported per kernel)
                row["error"] = f"{type(e).__name__}: {str(e)[-600:]}"
            rows.append(row)
    return rows


def problems(row: dict) -> list[str]:
    if "error" in row:
        return [row["error"]]
    if row.get("registers") is None or row.get("spill_bytes") is None:
        return ["cuobjdump's resource usage not read"]
    out = []
    if row["shared_bytes"] > SMEM_LIMIT:
        out.append(f"{row['shared_bytes']} bytes of shared memory > {SMEM_LIMIT}")
    if row["spill_bytes"]:
        out.append(f"{row['spill_bytes']} bytes spilled")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("sm90_compile: unset TRITON_INTERPRET (Gluon compiles only)")
    rows = compile_all()
    if args.json:
        print(json.dumps(rows, indent=1))
    bad = 0
    for row in rows:
        issues = problems(row)
        bad += bool(issues)
        if not args.json:
            state = "; ".join(issues) or (
                f"ok: {row['shared_bytes']} B shared, {row['registers']} registers"
            )
            print(f"{row['kernel']:<32} {state}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
