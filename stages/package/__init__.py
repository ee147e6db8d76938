"""The package stage: the engines that passed validation, with their metadata, laid out as Triton model
repositories (``triton.py`` writes them)."""
