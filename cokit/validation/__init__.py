"""The compression validation study's runner and ``--on`` calibration on your own model.

:mod:`~cokit.validation.grid` runs methods x lrs x seeds on workloads (local gloo ranks,
resumable) and :mod:`~cokit.validation.report` writes the tables and plots;
:mod:`~cokit.validation.calibrate` builds ``--on``'s grid on your factory
(:mod:`~cokit.validation.user_workload`); :mod:`~cokit.validation.cli` is ``cokit bench
validate``. The study's own workloads and protocols are a source checkout's
(``cokit.bench.study``).
"""
