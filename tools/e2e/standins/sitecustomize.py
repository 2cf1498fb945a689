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
