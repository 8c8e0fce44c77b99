"""Automatic speech recognition: preprocessing, encoders, CTC, tokenizers and metrics."""
