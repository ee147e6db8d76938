"""Validate stage: every engine against the PyTorch model (or the FP32 ONNX model), with gates."""
