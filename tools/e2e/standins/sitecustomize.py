"""Harness patches applied in every process of an end-to-end server on the H200 (test harness only).

Where sglang 0.5.23 reaches a binary package that cannot load on the test machine and an in-tree
equivalent exists, route to it when the module is first imported:

* ``kernels/ops/layernorm/mhc.hc_split_sinkhorn``: TileLang (no SM90 fallback) -> the in-tree
  Triton port, which upstream uses on gfx1250 and documents as numerically identical.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

_AFTER_IMPORT = {}


def _after_import(name):
    def register(fn):
        _AFTER_IMPORT[name] = fn
        return fn

    return register


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _AFTER_IMPORT:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            _AFTER_IMPORT[fullname](module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())


@_after_import("sglang.kernels.ops.layernorm.mhc")
def _sinkhorn_on_triton(mhc):
    mhc.is_gfx1250_supported = (
        lambda: True
    )  # read by hc_split_sinkhorn alone, at call time


# ---- feature probes and fault injection (the matrix sets these per row; test harness only)
#
# E2E_PROBES="module:qualname,module:qualname?kwarg,...": wrap each named function (a module
# function or ``Class.method``) of the engine when its module is imported, and print one line
# to the server log at its 1st, 10th, 100th, ... call ("e2e probe: <name> call <n> -> <result>");
# with ``?kwarg`` only calls passing a truthy ``kwarg`` count. A row that names a probe fails
# unless its line is in the log: the feature's code ran (under CUDA graphs: was captured).
# A probe whose call passes a CUDA tensor also adds 1 to a counter on that device in the same
# stream, so a captured call counts at every replay; when the file E2E_PROBE_DUMP appears (the
# harness creates it after the row's requests) the process prints each such counter
# ("e2e probe: <name> device count <n>") and "e2e probe: device counts dumped".
#
# E2E_FAULT=<name>: a deliberately wrong engine for a negative control (never a switch in the
# engine itself), changing results by construction, far beyond rounding:
#   wo_a_group_x2  the wo_a twin's kernels return group 0's outputs doubled (a 2x scale error)
#   tau_q_at_T     the DSpark draft samples at tau x T, but the accept rule reads q at T
#   tau_q_3pct     the accept rule reads q at 1.03 x the temperature the draft samples at
#   speculation_off  the server drops every --speculative-* argument before parsing: it serves
#                  without speculation although the row asked for DSpark


def _short(value) -> str:
    shape = getattr(value, "shape", None)
    return f"tensor{tuple(shape)}" if shape is not None else repr(value)[:60]


def _wrap_probe(module, qualname: str, kwarg: str) -> None:
    import functools
    import inspect

    *path, attr = qualname.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    raw = inspect.getattr_static(owner, attr)
    kind = type(raw) if isinstance(raw, (staticmethod, classmethod)) else None
    fn = raw.__func__ if kind else raw
    name = f"{module.__name__}:{qualname}"
    count = [0]

    @functools.wraps(fn)
    def probe(*args, **kwargs):
        result = fn(*args, **kwargs)
        if not kwarg or kwargs.get(kwarg):
            _count_on_device(name, args, kwargs)
            count[0] += 1
            if count[0] in (1, 10, 100, 1000, 10000, 100000):
                print(
                    f"e2e probe: {name} call {count[0]} -> {_short(result)}", flush=True
                )
        return result

    setattr(owner, attr, kind(probe) if kind else probe)


_DEVICE_COUNTS: dict = {}


def _count_on_device(name: str, args, kwargs) -> None:
    """Adds 1 to ``name``'s device counter (made at its first call with a CUDA tensor)."""
    counter = _DEVICE_COUNTS.get(name)
    if counter is None:
        import torch

        device = next(
            (
                a.device
                for a in list(args) + list(kwargs.values())
                if isinstance(a, torch.Tensor) and a.is_cuda
            ),
            None,
        )
        if device is None:
            return
        if not _DEVICE_COUNTS:
            _start_dump_thread()
        counter = _DEVICE_COUNTS[name] = torch.zeros(
            1, dtype=torch.int64, device=device
        )
    counter.add_(1)


def _start_dump_thread() -> None:
    import os
    import threading
    import time

    path = os.environ.get("E2E_PROBE_DUMP")
    if not path:
        return

    def dump():
        while not os.path.exists(path):
            time.sleep(0.5)
        for name, counter in list(_DEVICE_COUNTS.items()):
            print(f"e2e probe: {name} device count {int(counter.item())}", flush=True)
        print("e2e probe: device counts dumped", flush=True)

    threading.Thread(target=dump, daemon=True, name="e2e-probe-dump").start()


def _register_probes(spec: str) -> None:
    by_module: dict = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        target, _, kwarg = item.partition("?")
        module, _, qualname = target.partition(":")
        by_module.setdefault(module, []).append((qualname, kwarg))
    for module, probes in by_module.items():

        def patch(mod, probes=probes):
            for qualname, kwarg in probes:
                _wrap_probe(mod, qualname, kwarg)

        previous = _AFTER_IMPORT.get(module)
        _AFTER_IMPORT[module] = (
            patch if previous is None else (lambda m, a=previous, b=patch: (a(m), b(m)))
        )


def _wo_a_group_x2(sm90):
    import functools

    for name in ("wo_a_fp8_small_sm90", "wo_a_fp8_mid_sm90"):
        fn = getattr(sm90, name)

        @functools.wraps(fn)
        def doubled(*args, _fn=fn, **kwargs):
            out = _fn(*args, **kwargs)
            if not kwargs.get("partials"):
                out[:, 0].mul_(
                    2.0
                )  # [rows, groups, rank]: group 0 as if its scale were 2x
            return out

        setattr(sm90, name, doubled)


def _tau_q_at_t(tau_module):
    def scale():
        return tau_module.draft_temperature_scale()

    def stage_draft_temperatures(params, draft_temperatures, bs):
        if draft_temperatures is params.temperatures:
            return
        draft_temperatures[:bs].copy_(params.temperatures[:bs])  # q at T: the fault
        params.step_temperatures[:bs].mul_(
            scale()
        )  # the draft still samples at tau x T

    def scale_draft_params(params):
        tau = scale()
        if tau == 1.0:
            return params
        return params._replace(step_temperatures=params.step_temperatures * tau)

    tau_module.stage_draft_temperatures = stage_draft_temperatures
    tau_module.scale_draft_params = scale_draft_params


def _tau_q_3pct(tau_module):
    """q read at 1.03 x the draft's sampling temperature (tau x T) at every drafted position."""
    stage = tau_module.stage_draft_temperatures

    def stage_draft_temperatures(params, draft_temperatures, bs):
        stage(params, draft_temperatures, bs)
        if draft_temperatures is not params.temperatures:
            draft_temperatures[:bs].mul_(1.03)

    scale = tau_module.scale_draft_params

    def scale_draft_params(params):
        out = scale(params)
        if out is params:
            return out
        return out._replace(temperatures=out.temperatures * 1.03)

    tau_module.stage_draft_temperatures = stage_draft_temperatures
    tau_module.scale_draft_params = scale_draft_params


def without_speculation(argv: list) -> list:
    """``argv`` without its ``--speculative-*`` options and their values."""
    kept, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("--"):
            continue
        skip = arg.startswith("--speculative-")
        if not skip:
            kept.append(arg)
    return kept


def _speculation_off(server_args):
    prepare = server_args.prepare_server_args
    server_args.prepare_server_args = lambda argv: prepare(without_speculation(argv))


_FAULTS = {
    "speculation_off": ("sglang.srt.server_args", _speculation_off),
    "tau_q_3pct": (
        "sglang.srt.speculative.dspark_components.dspark_draft_tau",
        _tau_q_3pct,
    ),
    "wo_a_group_x2": ("sglang.kernels.ops.gemm.dsv4_wo_a_fp8_sm90", _wo_a_group_x2),
    "tau_q_at_T": (
        "sglang.srt.speculative.dspark_components.dspark_draft_tau",
        _tau_q_at_t,
    ),
}


def _configure_from_env() -> None:
    import os

    fault = os.environ.get("E2E_FAULT")
    if fault:
        module, fn = _FAULTS[fault]
        _AFTER_IMPORT[module] = fn
    if os.environ.get("E2E_PROBES"):
        _register_probes(os.environ["E2E_PROBES"])


_configure_from_env()
