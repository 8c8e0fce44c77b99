"""SALM: a speech-augmented LLM (audio perception + modality adapter + a Megatron GPT backbone)."""
