"""Pipeline entry of the train stage: train the configured model, or take a user's checkpoint."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from models.registry import build_model
from pipeline.stage import StageContext
from stages.train.loop import evaluate, train
from stages.train.model_io import load_weights, read_state_dict, save_trained


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.config
    model = build_model(cfg.model.name, cfg.model.params)
    data = ctx.dataset()
    if cfg.model.checkpoint:
        load_weights(model, read_state_dict(Path(cfg.model.checkpoint)), cfg.model.checkpoint)
    if cfg.model.checkpoint or not cfg.train.enabled:
        model.eval()
        acc = evaluate(model, data.val_x, data.val_y, __import__("torch").device("cpu"))
        save_trained(ctx.out, model, cfg, {"source": cfg.model.checkpoint or "random init"})
        ctx.log.info("training skipped (%s); val accuracy %.4f", cfg.model.checkpoint or "train.enabled: false", acc)
        return {"status": "skipped", "val_accuracy": acc, "source": cfg.model.checkpoint or "random init"}
    result = train(model, data, cfg.train, seed=cfg.seed, progress=ctx.progress)
    summary = result.summary()
    save_trained(ctx.out, model, cfg, {"dataset": data.name, "input_shape": list(data.input_shape)})
    ctx.log.info("trained %d epochs (%s on %s): val accuracy %.4f", cfg.train.epochs, result.precision,
                 result.device, summary["val_accuracy"])
    return summary
