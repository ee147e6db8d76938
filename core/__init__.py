"""Kiln's base layer: errors, artifacts and hashing, ONNX I/O, the dataset contract, typed records and the
comparator. It imports nothing from the layers above it (the stages, the pipeline, the CLI)."""
