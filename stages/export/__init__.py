"""The export stage: the trained PyTorch model to ONNX with a dynamic batch axis, checked, shape-inferred and
proven to compute the same function (``stage.py``), or a user's ONNX file taken in its place."""
