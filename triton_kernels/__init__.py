"""Triton kernels of cokit (one family per module) and their backend layer.

Import the family you need, e.g. ``from triton_kernels.dct import dct_encode``; importing a
family registers its ``cokit::`` torch.library ops.
"""
