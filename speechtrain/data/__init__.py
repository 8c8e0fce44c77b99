"""Speech data: manifests, datasets, collators, samplers and loaders (built-in corpora: :mod:`speechtrain.corpora`)."""
