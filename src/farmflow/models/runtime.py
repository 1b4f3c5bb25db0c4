"""Where and how the training loops run: device, mixed precision, micro-batches, processes.

One `Runtime` per training loop wraps an `accelerate.Accelerator`:

* **device**: this process's GPU when there is one (``cuda:<local rank>`` under
  ``accelerate launch``), else the CPU;
* **mixed precision** from the weights' dtype (`ModelConfig.dtype`): on a GPU, bf16/fp16
  weights train with bf16/fp16 autocast and float32 master copies of the trained parameters,
  and are saved back in their own dtype. On a CPU with native bfloat16 (avx512_bf16 or AMX),
  bf16 weights do the same (SmolLM2-135M's reward model trains 2.4x as fast as in float32 on a 2-core
  EPYC). Half-precision weights the CPU cannot mix (fp16, no loss scaler there; bf16 where it is
  emulated, far slower than float32) train in float32, every parameter upcast, and are saved back in their
  dtype: float32 is the fast path there, and updates of a small learning rate are not rounded
  away as in pure half precision. The loaders upcast such weights already (`for_compute`), so
  sampling and scoring compute in float32 there too. Float32 weights: no autocast, exactly as
  without a runtime;
* **data parallelism and gradient accumulation**: every process builds the same global batch
  (`farmflow.models.batch_order` is a pure function of the step), takes its contiguous share
  and splits it into micro-batches (`micro_batches`). Each micro-batch's loss is weighted by
  its share of the global batch (`backward`), so one optimizer step equals the unaccumulated
  single-process step up to float rounding. (SFT's share is its share of the response tokens,
  the reward model's and DPO's of the pairs. PPO and Quark weight a micro-batch by its share
  of the rows, as alpaca_farm does, so there splitting a minibatch whose responses differ in
  length changes its token-mean loss slightly; one micro-batch per minibatch is exact.)
* ``accelerator.prepare`` for model and optimizer, ``accelerator.backward``, gradient clipping
  through the accelerator (DDP, FSDP and DeepSpeed each clip their own way), and only the
  main process writes: `finish` leaves the model as `farmflow.models.save` should write it
  (back in its dtype; under FSDP/DeepSpeed with its full state dict gathered on rank 0), and
  checkpoints are written by rank 0 only;
* **LoRA** (`adapt`/`finish`): when the checkpoint's config carries ``farmflow_lora`` (set
  from `ModelConfig.lora`), policy training wraps the model with peft adapters and merges
  them into the weights at the end, so every later stage loads a plain Hugging Face model.

A loop reads like this (see `farmflow.methods.sft`)::

    rt = Runtime(model, batch_size, cfg.micro_batch_size, "sft")
    rt.adapt(model)                                          # LoRA, when asked for
    opt, sched = optimizer_and_schedule(model, ...)
    model, opt = rt.prepare(model, opt)
    for step in ...:
        for rows in rt.micro_batches():
            with rt.accumulate(model):
                loss = ...
                rt.backward(loss, share_of_the_global_batch)
                rt.step(model, opt, sched, max_grad_norm)
    rt.finish(model)
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

FULL_STATE = "farmflow_full_state"
"""Attribute of a model trained under FSDP/DeepSpeed: its gathered full state dict (rank 0), for
`farmflow.models.save`."""
STORED_DTYPE = "farmflow_stored_dtype"
"""Attribute of a loaded model that computes in float32 where its half-precision weights would be emulated
(`for_compute`): the dtype it is stored in, which training saves it back in."""


def process_state():
    """accelerate's process state; without a GPU, several processes (``accelerate launch``, torchrun) join over gloo."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def default_device() -> torch.device:
    """Where this process puts models: its GPU (``cuda:<local rank>``) when it has one, else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return process_state().device


def device_of(model: torch.nn.Module) -> torch.device:
    """The device of a model's first parameter (inputs go there)."""
    return next(model.parameters()).device


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in tensors.items()}


def is_main_process() -> bool:
    """Rank 0, or the only process (nothing distributed started)."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def num_processes() -> int:
    """Processes of this run: the world size under ``accelerate launch`` (or torchrun), else 1."""
    return process_state().num_processes


def world_size() -> int:
    """Processes in torch.distributed's group (1 when none is started): the collectives below are no-ops at 1."""
    return torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1


def all_sum(t: torch.Tensor) -> torch.Tensor:
    """Elementwise sum of `t` over all processes, on `t`'s device; `t` itself when there is one process.

    A collective: every process calls it with a tensor of the same shape and dtype.
    """
    if world_size() == 1:
        return t
    on = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_backend() == "nccl"
        else torch.device("cpu")
    )
    out = t.detach().to(on, copy=True)
    torch.distributed.all_reduce(out)
    return out.to(t.device)


def all_gather_objects(obj: Any) -> list[Any]:
    """Every process's `obj` (picklable: lists, numbers, CPU tensors) in rank order; ``[obj]`` when there is one
    process.

    A collective: every process calls it.
    """
    if world_size() == 1:
        return [obj]
    out: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(out, obj)
    return out


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (Linux /proc/cpuinfo, read once per process; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    return frozenset(f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split())


def slow_half_precision(dtype: str, on_gpu: bool, flags: set[str] | frozenset[str]) -> bool:
    """Whether `dtype` weights would run on a CPU that emulates them (much slower than float32)."""
    native = {"bfloat16": {"avx512_bf16", "amx_bf16"}, "float16": {"avx512_fp16", "amx_fp16"}}.get(dtype)
    return native is not None and not on_gpu and not (native & flags)


def for_compute(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, in place, as it computes fastest here: half-precision weights this machine would emulate (bfloat16
    without avx512_bf16/AMX, float16 without avx512_fp16/AMX; never on a GPU) upcast to float32, their stored dtype
    kept on the model (`STORED_DTYPE`) for `Runtime` to save them back in. Float32 is far faster than emulated half
    precision, and its scores differ from the stored weights' only by half-precision rounding."""
    dtype = next(model.parameters()).dtype
    name = str(dtype).removeprefix("torch.")
    if slow_half_precision(name, default_device().type == "cuda", cpu_flags()):
        model.to(torch.float32)
        model.__dict__[STORED_DTYPE] = dtype
    return model


def cast_state(state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """`state`'s floating tensors in `dtype`; entries that share a tensor (tied weights) share its cast, so
    `save_pretrained` still sees them as tied."""
    cast: dict[tuple, torch.Tensor] = {}
    out = {}
    for name, v in state.items():
        if v.is_floating_point():
            ident = (v.data_ptr(), tuple(v.shape), v.stride())
            if ident not in cast:
                cast[ident] = v.to(dtype)
            v = cast[ident]
        out[name] = v
    return out


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """`model`'s parameters (and gradients) in `dtype`, in place; buffers stay as they are. A half-precision model
    loaded from its checkpoint keeps some in float32 (the rotary embedding's frequencies, made at load time, never
    saved): `module.to(dtype)` would round them, and the model would then score otherwise than the same weights
    loaded again."""
    for p in model.parameters():
        p.data = p.data.to(dtype)
        if p.grad is not None:
            p.grad = p.grad.to(dtype)


def stored_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype `model`'s weights are stored (and saved) in: their own, or the one `for_compute` upcast from."""
    return model.__dict__.get(STORED_DTYPE) or next(model.parameters()).dtype


def mixed_precision(dtype: torch.dtype, on_gpu: bool, flags: set[str] | frozenset[str]) -> str:
    """Accelerate's mixed precision for weights of `dtype`: bf16/fp16 autocast over float32 master weights on a GPU,
    bf16 on a CPU that computes it natively (`flags`: `cpu_flags`), else "no" (no autocast; `Runtime` upcasts
    half-precision weights that cannot mix).

    fp16 never mixes on a CPU (no loss scaler there), nor bf16 on one that emulates it (slower than float32).
    """
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
    if on_gpu:
        return name
    return "bf16" if name == "bf16" and not slow_half_precision("bfloat16", False, flags) else "no"


class Runtime:
    """One training loop's accelerator: device, precision, micro-batches of this process's share.

    `batch_size` is the global batch of one optimizer step (over all processes); it must divide
    evenly between the processes. `micro_batch_size` (None: the whole share at once) bounds the
    sequences (or pairs) per forward pass.
    """

    def __init__(
        self, model: torch.nn.Module, batch_size: int, micro_batch_size: int | None = None, name: str = "train"
    ):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        self.name = name
        self.dtype = stored_dtype(model)  # saved back in it
        state = process_state()
        self.processes, self.rank = state.num_processes, state.process_index
        if batch_size % self.processes:
            raise ValueError(
                f"{name}: the batch of {batch_size} does not split evenly over {self.processes} processes; "
                "choose a batch size divisible by execution.num_processes"
            )
        self.batch_size = batch_size
        self.share = batch_size // self.processes
        self.micro = min(micro_batch_size or self.share, self.share)
        self.accumulation = math.ceil(self.share / self.micro)
        on_gpu = state.device.type == "cuda"
        self.precision = mixed_precision(self.dtype, on_gpu, cpu_flags())
        # half-precision weights a CPU cannot mix: computed and updated in float32, saved back in their dtype
        self.upcast = not on_gpu and self.precision == "no" and self.dtype in (torch.bfloat16, torch.float16)
        acc = AcceleratorState._shared_state
        if acc and acc.get("_mixed_precision") not in (None, self.precision) and self.processes == 1:
            AcceleratorState._reset_state()  # one process, a stage with another dtype: a fresh state, not an error
        self.accelerator = Accelerator(mixed_precision=self.precision, gradient_accumulation_steps=self.accumulation)
        self.device = self.accelerator.device
        self.lora = None
        self.original: torch.nn.Module | None = None  # the Hugging Face model the stage saves
        self.prepared: torch.nn.Module | None = None
        self.stats: dict[str, Any] = {}  # the last optimizer step's learning rate and gradient norm (before clipping)

    # --------------------------------------------------------------------- setup
    @property
    def is_main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def sharded(self) -> bool:
        """FSDP or DeepSpeed: parameters and optimizer state are split between processes."""
        return self.accelerator.distributed_type.value in ("FSDP", "DEEPSPEED")

    def adapt(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap `model` with LoRA adapters (in place) when its config asks for them; returns the module to train.

        Only the adapters train; `finish` merges them back into `model`'s weights.
        """
        self.original = model
        spec = getattr(model.config, "farmflow_lora", None)
        if not spec:
            return model
        from peft import LoraConfig, get_peft_model

        targets = spec["target_modules"]
        self.lora = get_peft_model(
            model,
            LoraConfig(
                r=spec["r"],
                lora_alpha=spec["alpha"],
                lora_dropout=spec["dropout"],
                bias="none",
                task_type="CAUSAL_LM",
                target_modules="all-linear" if targets == ["all-linear"] else targets,
            ),
        )
        return self.lora

    def prepare(self, model: torch.nn.Module, *rest: Any) -> tuple:
        """Place the model (and other modules, optimizers) with the accelerator; float32 master weights under mixed
        precision, every weight in float32 where half precision is upcast.

        `model` is the one that `farmflow.models.save` will save (the policy).
        """
        if self.original is None:
            self.original = self.unwrap(model)
        if (self.upcast or self.precision != "no") and self.dtype != torch.float32:
            self.original.__dict__[STORED_DTYPE] = self.dtype  # float32 from here on: snapshots save in its dtype
        for m in (model, *rest):
            if isinstance(m, torch.nn.Module):
                if self.upcast:
                    m.to(self.device, torch.float32)
                else:
                    m.to(self.device)
                for p in m.parameters() if self.precision != "no" else ():
                    if p.requires_grad and p.dtype != torch.float32:
                        p.data = p.data.float()
        ds = self.accelerator.state.deepspeed_plugin
        if ds is not None:  # no dataloader to infer them from: DeepSpeed gets our micro-batch and accumulation
            ds.deepspeed_config.update(
                train_micro_batch_size_per_gpu=self.micro, gradient_accumulation_steps=self.accumulation
            )
        prepared = self.accelerator.prepare(model, *rest)
        self.prepared = prepared[0] if rest else prepared
        return prepared if rest else (prepared,)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module behind a prepared one: no DDP/FSDP wrapper, but its autocast forward kept.

        Without DDP the prepared model IS the module, and accelerate strips the autocast
        wrapper in place (``keep_fp32_wrapper=False``): training would go on in float32.
        """
        return self.accelerator.unwrap_model(model, keep_fp32_wrapper=True)

    def checkpointer(self, ckpt):
        """`ckpt` as is, or switched off under FSDP/DeepSpeed (their sharded optimizer state is not ours to save)."""
        return ckpt.switched_off() if self.sharded and ckpt.enabled else ckpt

    # ----------------------------------------------------------------------- steps
    def micro_batches(self) -> list[slice]:
        """This process's micro-batches of a global batch: slices of its contiguous share."""
        start = self.rank * self.share
        return [slice(s, min(s + self.micro, start + self.share)) for s in range(start, start + self.share, self.micro)]

    def local_micro_batches(self) -> list[slice]:
        """This process's micro-batches as slices of its own share (0 .. share): for loops where each process holds only
        its share."""
        return [slice(s, min(s + self.micro, self.share)) for s in range(0, self.share, self.micro)]

    def accumulate(self, *models: torch.nn.Module):
        """Context for one micro-batch: gradients are synced (and the optimizer steps) on the last one only."""
        return self.accelerator.accumulate(*models)

    def backward(self, loss: torch.Tensor, share: float | torch.Tensor = 1.0) -> None:
        """Backward of a micro-batch's mean loss that makes up `share` of the global batch's loss.

        Processes average their gradients and accelerate divides by the accumulation steps, so
        the loss is scaled by both: the sum over micro-batches and processes is the global mean.
        """
        self.accelerator.backward(loss * (share * (self.processes * self.accumulation)))

    def step(self, model: torch.nn.Module | list[torch.nn.Parameter], opt, sched, max_grad_norm: float) -> None:
        """Clip (a model's or a list of parameters), step, schedule and zero the gradients after the last micro-batch of
        a step."""
        if not self.accelerator.sync_gradients:
            return
        norm = self.accelerator.clip_grad_norm_(
            model.parameters() if isinstance(model, torch.nn.Module) else model, max_grad_norm
        )
        self.stats = {"lr": opt.param_groups[0]["lr"], "grad_norm": norm}  # for the metrics row (a tensor: no sync)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)

    def sum(self, value: torch.Tensor | float) -> float:
        """Sum of a per-process number over all processes (losses, counts for metrics)."""
        if self.processes == 1:
            return float(value)
        t = torch.as_tensor(value, dtype=torch.float64, device=self.device).reshape(1)
        return float(self.accelerator.reduce(t, "sum")[0])

    def plain(self, model: torch.nn.Module) -> torch.nn.Module:
        """The model as a plain Hugging Face model in the middle of training (a merged copy under LoRA), e.g. for
        snapshots."""
        if self.lora is None:
            return self.unwrap(model)
        import copy

        return copy.deepcopy(self.lora).merge_and_unload()

    def finish(self, model: torch.nn.Module) -> None:
        """After training (every process): leave the model as `farmflow.models.save` writes it.

        LoRA adapters are merged into the weights (the model object becomes a plain model
        again); float32 master weights go back to the stored dtype; under FSDP/DeepSpeed the
        full state dict is gathered (a collective) and kept on the model for rank 0 to save.
        """
        if self.lora is not None:
            self.lora.merge_and_unload()
            self.lora = None
        if self.sharded:
            state = self.accelerator.get_state_dict(self.prepared)
            if self.dtype != torch.float32:
                state = cast_state(state, self.dtype)
            self.original.__dict__[FULL_STATE] = state if self.is_main else None
        elif self.precision != "no" or self.upcast:
            cast_parameters(self.original, self.dtype)
            self.original.__dict__.pop(STORED_DTYPE, None)  # back in its stored dtype
