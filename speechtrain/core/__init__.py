"""Model base class and archive, typed configs, the Hydra entry point and the run manager."""
