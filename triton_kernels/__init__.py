"""Triton kernels of cokit (one family per module) and their backend layer.

Import the family you need, e.g. ``from cokit.triton_kernels.dct import dct_encode``; importing a
family registers its ``cokit::`` torch.library ops.
"""

import os as _os

# Triton 3.9 warns when this is unset; "1" is its current default (FP fusion on), kept here.
_os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

if _os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    # triton 3.6's interpreter needs a fix to loop over scalar arguments (see _compat)
    from ._compat import fix_interpreter_scalar_index as _fix

    _fix()
