"""The validation study's own parts, in a source checkout only (the wheel leaves them out).

* :mod:`~cokit.bench.study.presets` -- the grid protocol's presets and its three workloads;
* :mod:`~cokit.bench.study.transfer` -- the held-out protocol (its arithmetic in
  :mod:`~cokit.bench.study.transfer_report`);
* :mod:`~cokit.bench.study.digits`, :mod:`~cokit.bench.study.digits_cnn`,
  :mod:`~cokit.bench.study.digits_ae` -- the digits MLP, CNN and convolutional autoencoder.

Both protocols run through the grid runner every install has (:mod:`cokit.validation.grid`);
``cokit bench validate`` is their command line (:mod:`cokit.validation.cli`).
"""
