"""Speech data: manifests, datasets, collators, samplers and the built-in synthetic corpus."""
