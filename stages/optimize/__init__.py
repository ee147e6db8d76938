"""Graph optimization with onnx-graphsurgeon."""
