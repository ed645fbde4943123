"""SGLang 0.5.23 in .venv-engines: installed without its dependencies (scripts/engines_env.sh), its
modules imported with torch 2.13.0's CPU build. Imported by tests/_engines_tasks.py before any
SGLang module.

Its distributed layer (sglang.srt.distributed.parallel_state, communication_op, the plugin
loader and HookRegistry, the phase guards nvrar's hooks read) imports with what vLLM 0.33.0's
dependencies bring plus IPython (sglang.utils imports IPython.display; scripts/engines_env.sh
installs it), except for one package, replaced here by a stub (2026-12-03):

* ``torchvision``: initialize_model_parallel's imports reach SGLang's model configurations
  (sampler -> ... -> mem_cache.memory_pool -> configs.mamba_utils -> configs.nano_nemotron_vl,
  configs.deepseek_ocr, ...), which import torchvision.transforms at module level for image
  preprocessing. torchvision cannot load with torch 2.13.0's CPU build: the registry's
  torchvision 0.28.0 (the release for torch 2.13) is the CUDA build, whose operators fail to
  register there ("operator torchvision::nms does not exist"), and a torchvision that is
  installed but broken breaks transformers' image utilities too. So it is not installed, and the
  stub stands in for it: every name in it is an inert placeholder (no image is ever processed
  in these tests). transformers is asked first whether torchvision is available (it answers no
  and caches that), so transformers itself never uses the stub.

STUBBED lists the packages stubbed (only where importing the real one fails).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
from importlib.machinery import ModuleSpec
from typing import List, Optional

STUBS = ("torchvision",)
STUBBED: List[str] = []


class _Placeholder:
    """Any attribute, call, subscript or class base of a stubbed module: inert."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> "_Placeholder":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: object, **kwargs: object) -> "_Placeholder":
        return _Placeholder(f"{self._name}()")

    def __getitem__(self, key: object) -> "_Placeholder":
        return _Placeholder(f"{self._name}[]")

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (object,)

    def __repr__(self) -> str:
        return f"<stub {self._name}>"


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, root: str) -> None:
        self.root = root

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> Optional[ModuleSpec]:
        if fullname == self.root or fullname.startswith(self.root + "."):
            return ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: ModuleSpec) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__doc__ = "stub: cannot load with torch 2.13.0's CPU build (tests/_engines_sglang_env.py)"
        module.__path__ = []
        name = spec.name

        def __getattr__(attr: str) -> _Placeholder:
            if attr.startswith("__"):
                raise AttributeError(attr)
            return _Placeholder(f"{name}.{attr}")

        module.__getattr__ = __getattr__  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def _stub(name: str) -> None:
    if importlib.util.find_spec(name) is not None:
        try:
            importlib.import_module(name)
            return
        except Exception:  # installed, but it cannot load here
            for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
                del sys.modules[mod]
    sys.meta_path.insert(0, _StubFinder(name))
    STUBBED.append(name)


# transformers decides once (lru_cache) whether torchvision is there: before the stub exists.
from transformers.utils import import_utils as _hf_import_utils  # noqa: E402

_hf_import_utils.is_torchvision_available()
for _name in STUBS:
    _stub(_name)
