"""Engine builders (ONNX Runtime, TensorRT) and runners that load a built engine directory.

Serving code loads an engine with :func:`kiln.stages.engines.backend.load_engine`.
"""

# Each a folder here, registered by kiln.stages.engines.registry (a test holds the two equal): the CLI offers the
# names without importing the backends.
BACKEND_NAMES = ("onnxruntime", "tensorrt", "torch")
