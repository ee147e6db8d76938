"""The package stage: the engines that passed validation, with their metadata, laid out as Triton model
repositories (``triton.py`` writes them)."""

INDEX = "kiln-package.json"  # the package's own index (its models), beside engines/: a folder Kiln's package wrote
