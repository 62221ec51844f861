"""cokit: Triton kernels for compressed and overlapped distributed training.

Subpackages: ``cokit.triton_kernels`` (kernels, launchers, ``cokit::`` ops),
``cokit.compress`` (DeMo and codecs), ``cokit.overlap`` (overlapped schedules),
``cokit.bench`` (benchmarks), and the application modules (CLI, demo, studies).
"""

from cokit import _source_tree
from cokit._versions import check_versions

__version__ = "0.1.0"

_source_tree.install(__path__[0])
check_versions()
