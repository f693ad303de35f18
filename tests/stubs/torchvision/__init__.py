"""Test-only stand-in for torchvision (tests/framework puts tests/stubs on sys.path).

SGLang and vLLM import torchvision at module level through their multimodal model
configs, but the only torchvision wheels on PyPI are CUDA-linked and fail to load next to
the CPU torch build. The MoE/dispatcher code under test never calls into torchvision, so
this stub only has to make imports succeed: any ``torchvision.<sub>`` module is created on
demand, and any attribute is a placeholder class, except for the few enums that callers
read members from at import time.
"""

from __future__ import annotations

import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+pcie_a2a_stub"
PCIE_A2A_STUB = True


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4


_ENUMS = {"InterpolationMode": InterpolationMode, "ImageReadMode": ImageReadMode}


def _placeholder(module: str, name: str) -> type:
    def _unavailable(*_args, **_kwargs):
        raise RuntimeError(f"{module}.{name} is a test stub: the real torchvision is not installed")

    return type(name, (), {"__init__": _unavailable, "__module__": module})


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = _ENUMS.get(name) or _placeholder(self.__name__, name)
        setattr(self, name, value)
        return value


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(__name__ + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        setattr(sys.modules[parent], child, module)


if not any(isinstance(f, _Finder) for f in sys.meta_path):
    sys.meta_path.append(_Finder())

# Attribute access on the package itself (torchvision.transforms, torchvision.ops, ...).
sys.modules[__name__].__class__ = _StubModule
for _name, _enum in _ENUMS.items():
    setattr(sys.modules[__name__], _name, _enum)
