"""Engine builders (ONNX Runtime, TensorRT) and runners that load a built engine directory.

Serving code loads an engine with :func:`kiln.stages.engines.backend.load_engine`.
"""
