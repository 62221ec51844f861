"""Drop-in helpers for the stacks people train with: accelerate, the HF Trainer and Lightning.

DeMo and SparseLoCo exchange compressed updates themselves, so the model must *not* be wrapped
in ``DistributedDataParallel`` (its dense all-reduce would sync every gradient twice), and their
state holds one error buffer per rank, which a checkpoint written by rank 0 alone loses. The
modules here fix both for each stack (``import cokit.integrations`` imports none of them; each
needs its library: ``pip install 'cokit[hf]'`` or ``'cokit[lightning]'``):

* :mod:`cokit.integrations.state`: every rank's optimizer (or hook) state in one file, and
  rank 0's weights broadcast as DDP would (no extra library);
* :mod:`cokit.integrations.accelerate`: ``prepare`` (DeMo/SparseLoCo without DDP) and
  ``register_comm_hook`` (a plain optimizer on DDP with the cokit hook);
* :mod:`cokit.integrations.hf`: ``CokitTrainer``, a ``transformers.Trainer``;
* :mod:`cokit.integrations.lightning`: ``CokitStrategy`` (no DDP) and ``CommHookDDPStrategy``
  (the hook registered on every device, CPU included).

The DDP comm hook (:func:`cokit.compress.hooks.dct_topk_hook`) is the other route: a plain
optimizer (AdamW) on a DDP model whose gradients the hook compresses.
"""

from __future__ import annotations

__all__: list[str] = []
