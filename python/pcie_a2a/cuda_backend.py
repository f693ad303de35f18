"""The old name of :mod:`pcie_a2a.transport.cuda` (the CUDA transport moved there).

This is that module itself, not a copy: ``import pcie_a2a.cuda_backend`` and
``from pcie_a2a import cuda_backend`` give the same module object, so attributes set on
one (tests replace ``native``, ``_device``, ...) are seen by the other.
"""

import sys

from pcie_a2a.transport import cuda as _cuda

sys.modules[__name__] = _cuda
