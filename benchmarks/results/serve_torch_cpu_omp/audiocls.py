"""A transformers Wav2Vec2 audio classifier (tiny config) on synthetic tones: float audio, dynamic length."""
import math

import torch
from kiln import DatasetSplits
from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification


def build(num_labels: int = 3) -> torch.nn.Module:
    cfg = Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_feat_extract_layers=3,
        num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, num_labels=num_labels,
        classifier_proj_size=16, feat_extract_norm="group", do_stable_layer_norm=False,
    )
    return Wav2Vec2ForSequenceClassification(cfg)


def load(size: int = 192, length: int = 1600) -> DatasetSplits:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (size,), generator=g)
    t = torch.arange(length) / 16000.0
    freq = (200.0 + 300.0 * y.float())[:, None]
    x = torch.sin(2 * math.pi * freq * t) + 0.1 * torch.randn(size, length, generator=g)
    split = size * 3 // 4
    return DatasetSplits(x[:split], y[:split], x[split:], y[split:], num_classes=3)
