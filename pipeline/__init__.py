"""The pipeline layer: the assembled run config, the stage order, the cached runner, the report and the Python
API (``run_pipeline``) that the CLI calls."""
