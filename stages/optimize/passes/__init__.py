"""Graph passes, one module per family. Importing a module registers its passes in ``registry.PASSES``."""
