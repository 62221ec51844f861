"""Triton kernels of cokit (one family per module) and their backend layer.

Import the family you need, e.g. ``from cokit.triton_kernels.dct import dct_encode``; importing a
family registers its ``cokit::`` torch.library ops.
"""

import os as _os

# Triton 3.9 warns when this is unset; "1" is its current default (FP fusion on), kept here.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
