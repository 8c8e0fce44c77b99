"""Offline data tools, each a command line (``python -m speechtrain.datatools.<tool> --help``):

- ``estimate_duration_bins``: bucket edges for a dataset (``bucket_duration_bins``);
- ``oomptimizer``: the largest batch per bucket that fits in memory (``bucket_batch_size``);
- ``to_shar``: NeMo manifests or lhotse cuts -> lhotse Shar shards;
- ``blend_weights``: temperature-sampled weights for an ``input_cfg`` blend.
"""
