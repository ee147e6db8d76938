"""Pipeline entry of the precision stage: one graph per configured precision, listed in variants.json."""
from __future__ import annotations

import json
import shutil
from typing import Any

from pipeline.errors import ConfigError
from pipeline.stage import StageContext


def run(ctx: StageContext) -> dict[str, Any]:
    src = ctx.inputs["optimize"] / "model.onnx"
    variants: dict[str, Any] = {}
    for precision in ctx.config.precision.variants:
        if precision != "fp32":
            raise ConfigError(f"precision '{precision}' is not available yet", hint="use precision.variants: [fp32]")
        (ctx.out / precision).mkdir()
        shutil.copy2(src, ctx.out / precision / "model.onnx")
        variants[precision] = {"path": f"{precision}/model.onnx", "kept_fp32": []}
    (ctx.out / "variants.json").write_text(json.dumps(variants, indent=2))
    return {"variants": variants}
