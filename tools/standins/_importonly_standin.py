"""Import-only stand-ins for binary dependencies that cannot load where the fork is tested.

sglang's ``sgl_kernel`` and ``deep_gemm`` are built for upstream's torch and do not load on
the H200 test machine (torch 2.11) or the CPU machines; ``IPython`` and ``torchvision`` are
absent or mismatched there. A stand-in lets the pure-Python modules import: every attribute
and submodule exists, and calling anything raises, so a test can never pass through one by
accident. Put this folder first on ``sys.path``.
"""

import importlib.abc
import importlib.machinery
import sys

_ROOTS: set[str] = set()


class _Stub:
    def __init__(self, name: str):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name} is an import-only stand-in (tools/standins): it cannot run here"
        )

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Stub(f"{self._name}.{attr}")

    def __repr__(self) -> str:
        return f"<import-only stand-in {self._name}>"


def _module_getattr(modname: str):
    def __getattr__(attr: str):
        if attr.startswith("__"):  # keep hasattr(mod, "__version__") honest
            raise AttributeError(f"module {modname!r} has no attribute {attr!r}")
        return _Stub(f"{modname}.{attr}")

    return __getattr__


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if "." in fullname and fullname.split(".")[0] in _ROOTS:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__path__ = []
        module.__getattr__ = _module_getattr(module.__name__)


_FINDER = _SubmoduleFinder()


def standin(name: str, namespace: dict, **attrs) -> None:
    _ROOTS.add(name)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    namespace["__getattr__"] = _module_getattr(name)
    namespace.update(attrs)
