"""Built-in model zoo and datasets, plus resolution of user ones by import path.

Models: ``cnn`` (Conv+BN+ReLU blocks, also ResNet-18 shaped via ``resnet18``), ``transformer``
(encoder classifier with explicit Q/K/V, LayerNorm, GELU; ``bert_base`` for the BERT-base shape),
``mlp_embed`` (recommender-style field embeddings + MLP).
"""

from kiln.models.registry import (
    DATASETS,
    MODELS,
    DatasetSplits,
    build_model,
    load_dataset,
    resolve_callable,
)

__all__ = ["MODELS", "DATASETS", "DatasetSplits", "build_model", "load_dataset", "resolve_callable"]
