"""The compression validation study: DeMo vs AdamW vs SGD-momentum vs PowerSGD at small scale.

``cokit bench validate`` / ``python benchmarks/validate_compression.py`` run it; see
:mod:`cokit.validation.study`.
"""
