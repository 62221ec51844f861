"""Validation study: DeMo vs AdamW vs SGD-momentum vs PowerSGD at small scale (CPU, gloo).

    python benchmarks/validate_compression.py            # full mode -> benchmarks/results/validation/
    python benchmarks/validate_compression.py --quick    # < 10 minutes on 2 CPU cores
    cokit bench validate [--quick]                       # the same

The study runs through cokit.validation (spawned ranks must import it); this script is its
command line, ``cokit bench validate``'s. ``--help`` lists the options.
"""

from __future__ import annotations

from cokit.validation.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
