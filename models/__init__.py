"""The built-in model zoo and datasets (``registry.MODELS``, ``registry.DATASETS``), model and dataset loading
(``model_io``), and resolution of a user's own by import path (``registry.resolve_callable``)."""
