"""Settings of the train stage: one strict section with small nested groups (unknown keys are errors)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from kiln.core.sections import AutoOnOff, Section


class AmpConfig(Section):
    """Loss scaling for fp16 (bf16 and fp32 need none)."""

    loss_scale: Literal["dynamic"] | float = Field(
        "dynamic", description="'dynamic' (GradScaler grows/backs off the scale) or a fixed scale, e.g. 1024"
    )
    init_scale: float = Field(2.0**16, gt=0, description="first scale of dynamic loss scaling")
    growth_interval: int = Field(2000, ge=1, description="overflow-free steps before the dynamic scale doubles")
    nonfinite_patience: int = Field(
        25, ge=0, description="consecutive steps with a NaN/Inf loss tolerated (skipped) before training aborts"
    )
    fp32_norms: bool = Field(True, description="run LayerNorm/GroupNorm/RMSNorm in FP32 where autocast would not")

    @model_validator(mode="after")
    def _static_positive(self) -> AmpConfig:
        if not isinstance(self.loss_scale, str) and self.loss_scale <= 0:
            raise ValueError("amp.loss_scale must be 'dynamic' or a positive number")
        return self


class LoaderConfig(Section):
    """torch DataLoader knobs (https://pytorch.org/docs/stable/data.html)."""

    num_workers: int = Field(0, ge=0, description="worker processes loading batches; 0 loads in the main process")
    pin_memory: bool | None = Field(None, description="page-locked host batches for faster copies; null: on CUDA")
    persistent_workers: bool = Field(False, description="keep workers alive between epochs (needs num_workers > 0)")
    prefetch_factor: int | None = Field(None, ge=1, description="batches each worker loads ahead (needs workers)")
    on_device: bool = Field(False, description="move the whole dataset to the device once (small data sets)")


class CheckpointConfig(Section):
    dir: str | None = Field(None, description="checkpoint folder; null: <workdir>/cache/train/<run key>")
    every_steps: int | None = Field(None, ge=1, description="also save the training state every N optimizer steps")
    resume: Literal["auto", "never"] | str = Field(
        "auto", description="'auto': continue an interrupted run of this config; 'never'; or a path to last.pt"
    )
    select: Literal["last", "best"] = Field("last", description="weights written as model.safetensors")


class DistributedConfig(Section):
    nproc_per_node: int = Field(1, ge=1, description="> 1: the stage launches torchrun with this many processes")
    backend: Literal["auto", "nccl", "gloo"] = Field("auto", description="auto: nccl on CUDA, gloo on CPU")
    bucket_cap_mb: float = Field(25.0, gt=0, description="DDP gradient bucket size")
    gradient_as_bucket_view: bool = Field(True, description="gradients alias the all-reduce buckets (saves memory)")
    sync_batchnorm: bool = Field(False, description="convert BatchNorm to SyncBatchNorm (CUDA only)")
    find_unused_parameters: bool = Field(
        False, description="true: DDP allows parameters the loss does not use (searches the graph each step: slower)"
    )


class CompileConfig(Section):
    """torch.compile settings (https://pytorch.org/docs/stable/generated/torch.compile.html)."""

    mode: Literal["default", "reduce-overhead", "max-autotune"] = Field(
        "default", description="inductor mode; reduce-overhead and max-autotune add CUDA graphs on GPUs"
    )
    dynamic: bool | None = Field(
        None,
        description="null/false: static graphs for a full batch's micro-batch shapes, calls of other shapes "
        "(a short last batch) run eagerly; true: one graph with symbolic shapes for every call",
    )
    fullgraph: bool = Field(
        False,
        description="true: a graph break or compile failure stops training with an "
        "error; false: graph breaks split the graph, a failure falls back to eager",
    )


class TrainConfig(Section):
    enabled: bool = Field(True, description="false skips training (use model.checkpoint or random init)")
    epochs: int = Field(8, ge=1)
    batch_size: int = Field(64, ge=1, description="global batch size per optimizer step (all processes together)")
    grad_accum_steps: int = Field(1, ge=1, description="micro-batches per optimizer step")
    lr: float = Field(3e-3, gt=0)
    min_lr: float = Field(0.0, ge=0, description="floor of the cosine/linear schedule")
    warmup_steps: int = Field(0, ge=0, description="linear LR warm-up from lr/100 over this many steps")
    weight_decay: float = Field(0.01, ge=0)
    optimizer: Literal["adamw", "sgd"] = "adamw"
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas, each in [0, 1)")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum, in [0, 1)")
    fused: bool | None = Field(None, description="fused optimizer kernels; null: on CUDA")
    schedule: Literal["constant", "cosine", "linear"] = "cosine"
    precision: Literal["auto", "fp32", "fp16", "bf16"] = Field(
        "auto", description="auto: fp16+GradScaler on CUDA, bf16 autocast on CPU"
    )
    grad_clip: float | None = Field(1.0, gt=0, description="clip global grad norm (after unscale); null disables")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    deterministic: bool = Field(False, description="torch.use_deterministic_algorithms + no cuDNN autotuning")
    eval_every: int = Field(1, ge=1, description="validate every N epochs (and always after the last)")
    profile_steps: int = Field(0, ge=0, description="> 0: write a torch.profiler trace of this many steps (trace.json)")
    plot: bool = Field(True, description="write loss.png (train/val loss per epoch)")
    loss: str | None = Field(
        None,
        description="'package.module:function' taking (outputs, targets) -> scalar; null: "
        "cross-entropy for integer labels, mean squared error for float targets",
    )
    compile: bool | CompileConfig = Field(
        False, description="torch.compile the model: true (default settings) or {mode, dynamic, fullgraph}"
    )
    update_graph: AutoOnOff = Field(
        "auto",
        description="run the update after the backward pass (unscale, clip, checks, optimizer step, loss "
        "scale) as one CUDA graph: less host time per step; auto: one process on CUDA with a "
        "fused optimizer",
    )
    amp: AmpConfig = Field(default_factory=AmpConfig)
    loader: LoaderConfig = Field(default_factory=LoaderConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @property
    def compile_options(self) -> CompileConfig | None:
        """The torch.compile settings, or None when the model runs eagerly."""
        if isinstance(self.compile, CompileConfig):
            return self.compile
        return CompileConfig() if self.compile else None

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, betas: tuple[float, float]) -> tuple[float, float]:
        # torch.optim.AdamW would refuse them only when training starts, with a traceback
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError("each AdamW beta must be in [0, 1), e.g. [0.9, 0.999]")
        return betas

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> TrainConfig:
        # A floor above the peak would make the cosine/linear "decay" raise the LR
        if self.schedule != "constant" and self.min_lr > self.lr:
            raise ValueError(
                f"train.min_lr ({self.min_lr}) is above train.lr ({self.lr}): the {self.schedule} "
                "schedule decays from lr down to min_lr, so min_lr must not exceed lr"
            )
        return self
