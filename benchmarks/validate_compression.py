"""Validation study: DeMo vs AdamW vs SGD-momentum vs PowerSGD at small scale (CPU, gloo).

    python benchmarks/validate_compression.py            # full mode -> benchmarks/results/validation/
    python benchmarks/validate_compression.py --quick    # < 10 minutes on 2 CPU cores
    cokit bench validate [--quick]                       # the same

The study itself lives in cokit.validation (spawned ranks must import it); this script is its
command line. ``--help`` lists the options.
"""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

from cokit.validation.study import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
