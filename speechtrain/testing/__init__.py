"""Small models and data for tests and benchmarks (also handy for trying a parallel layout)."""
