"""TorchTitan 0.3.0's own pipeline code, driven on CPU ranks as its Trainer drives it (a real client
nobody here wrote): its llama3 split by `pipeline_llm` (its `parallelize_llama`: selective activation
checkpointing and FSDP2 even at dp=1), its schedule builder, its chunked loss, and its
`Trainer.pp_forward_backward_step`, the call, compiled unedited from its trainer.py. On pipecore it
runs after the one line `pipecore.compat.patch_torch_pipelining()`; on torch's runtime without it.

What is not TorchTitan's, and why:
- its device is set to "cpu" before it is imported (it takes "cuda" when it finds no accelerator), and
  float64 is added to its dtype table in memory, so that every comparison is in float64;
- trainer.py itself cannot be imported here (its metrics and validator import tensorboard and
  datasets): the three methods it runs are compiled from its source, with its own imports;
- FlexAttention (compiled) is swapped for its own causal SDPA attention;
- every rank's weights are overwritten with one seeded whole model's (it seeds each pipeline rank
  differently), so one process can be the reference;
- torch 2.13's `step()` lacks the keyword form trainer.py calls (TorchTitan 0.3.0 targets a newer
  torch): on torch's runtime only, `_TorchStepAdapter` calls torch's own `_step_microbatches`.

Adapted from a driver written for issue 49 (2 gloo ranks: dim 64, 4 layers, vocab 256, 32 tokens, 8
microbatches of 1).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import sys
import time
import types
from typing import Any, Callable

import torch

# --------------------------------------------------------------------------
# Fixed experiment shape (the llama3 "debugmodel" shrunk).
# --------------------------------------------------------------------------
DIM = 64
N_LAYERS = 4
N_HEADS = 4  # head_dim 16, the same as debugmodel (256 / 16)
VOCAB = 256
SEQ = 32
LOCAL_BATCH = 8  # training.local_batch_size
MICROBATCH = 1  # parallelism.pipeline_parallel_microbatch_size -> 8 microbatches
PP = 2
DEFAULT_SEED = 1234

SCHEDULES = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"]

_TRAINER_METHODS = ("post_dataloading_process", "forward_backward_step", "pp_forward_backward_step")

_STATE: dict[str, Any] = {}  # per-process cache of the torchtitan setup


# --------------------------------------------------------------------------
# TorchTitan setup (must run after `patch`, before any other torchtitan import)
# --------------------------------------------------------------------------
def _setup_torchtitan() -> dict[str, Any]:
    if _STATE:
        return _STATE
    # TorchTitan picks device_type at import time of torchtitan.tools.utils
    # ("cuda" when no accelerator is found). parallel_dims.py, distributed/utils.py
    # and others copy the value with `from ... import device_type`, so it must be
    # overwritten before they are imported.
    import torchtitan.tools.utils as tt_utils

    tt_utils.device_type = "cpu"
    tt_utils.device_module = torch.cpu

    # training.dtype / mixed_precision_* are looked up in TORCH_DTYPE_MAP
    # (trainer.py:366, parallelize.py apply_fsdp_to_decoder), which has no
    # float64. Adding the key in memory lets FSDP's MixedPrecisionPolicy keep
    # params and reductions in float64 (the installed file is not touched).
    from torchtitan.config import TORCH_DTYPE_MAP

    TORCH_DTYPE_MAP.setdefault("float64", torch.float64)

    # Decoder.Config.update_from_config does `from torchtitan.trainer import Trainer`
    # and `isinstance(config, Trainer.Config)`. trainer.py itself cannot be
    # imported here (components/metrics.py needs tensorboard); if so, register a
    # stand-in module whose Trainer.Config is the small dataclass below.
    trainer_importable = True
    try:
        import torchtitan.trainer  # noqa: F401
    except ImportError as e:
        trainer_importable = False
        _STATE["trainer_import_error"] = f"{type(e).__name__}: {e}"
        stub = types.ModuleType("torchtitan.trainer")
        stub.__file__ = "<titan_driver stand-in for torchtitan.trainer>"

        class Trainer:  # noqa: D401 - stand-in namespace only
            Config = _StandInTrainerConfig

        stub.Trainer = Trainer
        sys.modules["torchtitan.trainer"] = stub
    _STATE["trainer_importable"] = trainer_importable
    _STATE["tt_utils"] = tt_utils
    return _STATE


@dataclasses.dataclass(kw_only=True)
class _StandInTrainerConfig:
    """The fields of Trainer.Config that the code paths driven here read."""

    model_spec: Any
    training: Any
    parallelism: Any
    activation_checkpoint: Any
    loss: Any
    compile: Any
    debug: Any
    dump_folder: str = "./outputs"


def _trainer_py_path() -> str:
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer.py")


def _load_trainer_methods() -> dict[str, Callable]:
    """Compile Trainer.{post_dataloading_process, forward_backward_step,
    pp_forward_backward_step} straight from trainer.py's source.

    The namespace is built by executing trainer.py's own top-level import
    statements one by one (those that fail here, e.g. metrics -> tensorboard,
    are skipped; none of the three methods use them)."""
    if "methods" in _STATE:
        return _STATE["methods"]
    path = _trainer_py_path()
    with open(path) as f:
        src = f.read()
    tree = ast.parse(src, filename=path)
    ns: dict[str, Any] = {"__name__": "torchtitan_trainer_extract", "__file__": path}
    skipped = []
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            code = compile(ast.Module(body=[node], type_ignores=[]), path, "exec")
            try:
                exec(code, ns)
            except Exception as e:  # pragma: no cover - depends on env
                skipped.append(f"line {node.lineno}: {type(e).__name__}: {e}")
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Trainer"]
    fns = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name in _TRAINER_METHODS}
    assert set(fns) == set(_TRAINER_METHODS), sorted(fns)
    out = {}
    for name, fn in fns.items():
        # Keep the FunctionDef as is (decorators included), same file/line numbers.
        code = compile(ast.Module(body=[fn], type_ignores=[]), path, "exec")
        exec(code, ns)
        out[name] = ns[name]
        # Sanity: the compiled function's source is the exact text in trainer.py.
        assert ast.get_source_segment(src, fn) is not None
    _STATE["methods"] = out
    _STATE["trainer_import_skipped"] = skipped
    return out


# --------------------------------------------------------------------------
# Config: llama3 debugmodel (config_registry.py llama3_debugmodel) shrunk
# --------------------------------------------------------------------------
def _model_spec():
    """Mirror models/llama3/__init__.py `_debugmodel` + `model_registry`, with
    dim 64 / 4 layers / vocab 256 and TorchTitan's ScaledDotProductAttention
    (causal SDPA) as inner attention instead of FlexAttention.

    get_attention_config("sdpa") deliberately raises for language models in
    0.3.0, so layers are built with the "flex" config and the inner_attention
    config is then swapped for ScaledDotProductAttention.Config()."""
    import torchtitan.models.llama3 as L
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.protocols.model_spec import ModelSpec

    cfg = L.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)),
        layers=L._build_llama3_layers(
            fuse_qkv=True,
            n_layers=N_LAYERS,
            dim=DIM,
            n_heads=N_HEADS,
            hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=256),
            rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=131072, theta=500000, scaling="llama"),
            attn_backend="flex",
        ),
    )
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return ModelSpec(
        name="llama3",
        flavor="debugmodel_tiny_sdpa",
        model=cfg,
        parallelize_fn=L.parallelize_llama,
        pipelining_fn=L.pipeline_llm,
        post_optimizer_build_fn=None,
        state_dict_adapter=None,
    )


def _trainer_config(schedule: str, dp: int, csv_path: str | None, steps: int, seed: int, dtype: str,
                    spmd_backend: str | None, ac: str):
    """Trainer.Config as llama3_debugmodel() builds it (config_registry.py:34-70),
    shrunk, float32/64 everywhere (no bf16), PP=2."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size

    st = _setup_torchtitan()
    model_spec = _model_spec()
    training = TrainingConfig(
        local_batch_size=LOCAL_BATCH,
        seq_len=SEQ,
        steps=steps,
        dtype=dtype,
        # FSDP MixedPrecisionPolicy(param_dtype, reduce_dtype): keep the model dtype.
        mixed_precision_param=dtype,
        mixed_precision_reduce=dtype,
        # Trainer.Config._validate_cuda_graphs: PP requires this.
        disable_cuda_graphs=True,
    )
    par_kwargs = dict(
        pipeline_parallel_degree=PP,
        data_parallel_shard_degree=dp,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_schedule_csv=csv_path or "",
        pipeline_parallel_microbatch_size=MICROBATCH,
    )
    if spmd_backend is not None:
        par_kwargs["spmd_backend"] = spmd_backend
    parallelism = ParallelismConfig(**par_kwargs)
    ac_config = {"selective": SelectiveAC.Config(), "full": FullAC.Config(), "none": None}[ac]
    fields = dict(
        model_spec=model_spec,
        training=training,
        parallelism=parallelism,
        activation_checkpoint=ac_config,
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(model_spec))
        ),
        compile=CompileConfig(),
        debug=DebugConfig(seed=seed),
    )
    if st["trainer_importable"]:
        from torchtitan.trainer import Trainer

        return Trainer.Config(**fields)
    return _StandInTrainerConfig(**fields)


# --------------------------------------------------------------------------
# Data: one fixed batch, identical on every rank
# --------------------------------------------------------------------------
def _global_batch(dp: int, seed: int):
    """Token ids for the whole (dp * local_batch) batch from a seeded generator,
    with per-row positions (one document per row, as the dataloader emits
    `{"input", "positions"}`) and a few IGNORE_INDEX labels so that
    global_valid_tokens != numel."""
    from torchtitan.components.loss import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed + 99)
    rows = dp * LOCAL_BATCH
    toks = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    inputs, labels = toks[:, :-1].clone(), toks[:, 1:].clone()
    labels[1::3, -3:] = IGNORE_INDEX
    positions = torch.arange(SEQ).unsqueeze(0).expand(rows, SEQ).contiguous()
    return inputs, labels, positions


def _local_microbatches(dp_rank: int, seed: int, dp: int):
    """What the dataloader hands one dp replica: local_batch rows, as
    microbatches of pipeline_parallel_microbatch_size (trainer.py:570-574 dataloader
    batch size, 885-892)."""
    inputs, labels, positions = _global_batch(dp, seed)
    lo = dp_rank * LOCAL_BATCH
    mbs = []
    for i in range(lo, lo + LOCAL_BATCH, MICROBATCH):
        sl_ = slice(i, i + MICROBATCH)
        mbs.append(({"input": inputs[sl_].clone(), "positions": positions[sl_].clone()}, labels[sl_].clone()))
    return mbs


# --------------------------------------------------------------------------
# Reference weights: the whole model, built the Trainer way, seeded
# --------------------------------------------------------------------------
def _build_whole_model(config, seed: int):
    """Whole model as Trainer builds it (meta build trainer.py:364-367, then
    to_empty + init_weights trainer.py:501-506), with torch.manual_seed(seed)
    right before init so every process gets bit-identical weights."""
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.tools import utils

    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = config.model_spec.model.build()
    model.to_empty(device="cpu")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            model.init_weights(buffer_device=None)
    return model


def _canon(fqn: str) -> str:
    # AC wraps blocks in CheckpointWrapper -> "._checkpoint_wrapped_module" in names;
    # FSDP2 does not change names; layers keep their global index (ModuleDict keys).
    return fqn.replace("._checkpoint_wrapped_module", "").replace("_checkpoint_wrapped_module.", "")


def _as_f64(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().to("cpu", torch.float64).clone()


# --------------------------------------------------------------------------
# run(): one rank of the pipeline, driven like Trainer.__init__ + train_step
# --------------------------------------------------------------------------
def run(rank: int, world: int, schedule: str, dp: int = 1, csv_path: str | None = None, steps: int = 1,
        patch: Callable[[], Any] | None = None, *, seed: int = DEFAULT_SEED, dtype: str = "float64",
        lr: float = 0.0, spmd_backend: str | None = None, ac: str = "selective", evaluate: bool = False) -> dict:
    """Run `steps` steps of TorchTitan's Trainer.pp_forward_backward_step on this rank.

    Must be called inside an initialised gloo process group with world == PP * dp.
    `schedule` is TorchTitan's parallelism.pipeline_parallel_schedule; with
    `csv_path` it still decides the stage layout (stages/rank, loop vs V) while
    the CSV decides the order (TorchTitan then uses _PipelineScheduleRuntime).
    Returns {"losses": [float|None per step], "grads": {fqn: float64 CPU tensor},
    "info": {...}}. `lr` > 0 applies p -= lr * grad after each step (plain SGD,
    to make multi-step runs depend on earlier steps); default 0.
    """
    t_enter = time.perf_counter()
    if patch is not None:
        patch()  # before ANY torchtitan import (it may alias torch.distributed.pipelining)
    st = _setup_torchtitan()
    methods = _load_trainer_methods()

    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import ChunkedLossWrapper, IGNORE_INDEX
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.tools import utils

    assert dist.is_initialized(), "run() expects an initialised process group"
    assert world == dist.get_world_size() == PP * dp, (world, dist.get_world_size(), dp)
    t_start = time.perf_counter()

    config = _trainer_config(schedule, dp, csv_path, steps, seed, dtype, spmd_backend, ac)
    model_spec = config.model_spec

    self = types.SimpleNamespace()  # stand-in for the Trainer instance
    self.config = config
    # trainer.py:299-301 -- device from LOCAL_RANK (cpu:0 here: torch.cpu.device_count()==1)
    os.environ.setdefault("LOCAL_RANK", str(rank))
    self.device = utils.get_local_device()
    utils.device_module.set_device(self.device)
    # trainer.py:304 / 655-663 -- init_distributed() (dist_utils.init_distributed) returns early when the PG
    # already exists, then ParallelDims.from_config(config.parallelism, world).
    self.parallel_dims = parallel_dims = ParallelDims.from_config(config.parallelism, world)
    # trainer.py:319
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    # trainer.py:325-330
    if parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        batch_degree, batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        batch_degree, batch_rank = 1, 0
    # trainer.py:337-342 -- seeds (distinct per pp rank, so per-stage init differs;
    # the reference weights are copied in below).
    dist_utils.set_determinism(parallel_dims, self.device, config.debug, distinct_seed_mesh_dims=["pp"])
    # trainer.py:345-350
    model_config = model_spec.model
    model_config.update_from_config(config=config)
    self.model_config = model_config
    # trainer.py:364-375 -- build on meta in training.dtype
    with torch.device("meta"), utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = model_config.build()
    model.verify_module_protocol()
    # trainer.py:399-408 (no seed checkpoint, no cpu offload)
    init_device, buffer_device = utils.device_type, None
    # trainer.py:410-412
    self.loss_fn = config.loss.build(compile_config=config.compile)
    # trainer.py:415-438
    global_batch_size = config.training.local_batch_size * batch_degree
    self.gradient_accumulation_steps = global_batch_size // (config.training.local_batch_size * batch_degree)
    self.num_pipeline_parallel_microbatches = (
        config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size
    )
    # trainer.py:442-485 -- pipelining_fn (= pipeline_llm) with parallelize_fn
    # (= parallelize_llama: SelectiveAC + FSDP2) and the loss; it builds the
    # schedule through _build_pipeline_schedule.
    (self.pp_schedule, self.model_parts, self.pp_has_first_stage, self.pp_has_last_stage) = (
        model_spec.pipelining_fn(
            model,
            parallel_dims=parallel_dims,
            training=config.training,
            parallelism=config.parallelism,
            compile_config=config.compile,
            ac_config=config.activation_checkpoint,
            dump_folder=config.dump_folder,
            device=self.device,
            model_config=model_config,
            parallelize_fn=model_spec.parallelize_fn,
            loss_fn=self.loss_fn,
        )
    )
    del model
    # NOT Trainer: torch 2.13.0's schedule.step() has no keyword form
    # step(arg_mbs=, kwarg_mbs=, target_mbs=) that trainer.py:856 calls (TorchTitan
    # 0.3.0 targets a newer nightly); bridge it onto torch's own _step_microbatches.
    # Schedules whose step() takes arg_mbs (e.g. pipecore.compat's) are used as is.
    self.pp_schedule = _adapt_schedule(self.pp_schedule)
    for m in self.model_parts:  # trainer.py:473-479
        m.to_empty(device=init_device)
        with torch.no_grad():
            m.init_weights(buffer_device=buffer_device)
        m.train()
    # NOT Trainer: overwrite every parameter with the seeded whole-model weights
    # (what reference() uses) so all ranks/stages agree with the one-process run.
    ref_model = _build_whole_model(config, seed)
    ref_params = {n: p.detach() for n, p in ref_model.named_parameters()}
    with torch.no_grad():
        for m in self.model_parts:
            for n, p in m.named_parameters():
                full = ref_params[_canon(n)].to(p.dtype)
                if isinstance(p, DTensor):
                    p.copy_(distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None))
                else:
                    p.copy_(full)
    del ref_model, ref_params
    # trainer.py:513-525 -- chunked loss gets the last stage's lm_head; the
    # model then skips lm_head in forward.
    if isinstance(self.loss_fn, ChunkedLossWrapper) and self.pp_has_last_stage:
        lm_head = self.model_parts[-1].lm_head
        assert lm_head is not None
        self.loss_fn.set_lm_head(lm_head)
        self.model_parts[-1]._skip_lm_head = True
    # trainer.py:563-564
    self.step = 0
    self.ntokens_seen = 0
    # trainer.py:605-611
    self.train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims,
        spmd_typechecking=(config.parallelism.spmd_backend == "spmd_types" and config.debug.spmd_typechecking),
    )
    # Bind TorchTitan's own methods to the stand-in.
    for name, fn in methods.items():
        setattr(self, name, types.MethodType(fn, self))
    t_built = time.perf_counter()

    losses: list[float | None] = []
    step_times = []
    for _ in range(steps):
        self.step += 1
        ts = time.perf_counter()
        # trainer.py:874 optimizers.zero_grad(set_to_none=disable_cuda_graphs=True)
        for m in self.model_parts:
            for p in m.parameters():
                p.grad = None
        # trainer.py:882-892 -- fetch microbatches, count valid tokens
        microbatches = _local_microbatches(batch_rank, seed, dp)
        local_valid_tokens = torch.tensor(0, dtype=torch.int64)
        for _input_dict, labels in microbatches:
            local_valid_tokens += (labels != IGNORE_INDEX).sum()
        # trainer.py:896-903 -- global_valid_tokens (sum over the batch mesh)
        if parallel_dims.dp_enabled:
            global_valid_tokens = dist_utils.dist_sum_tensor(
                local_valid_tokens.to(self.device), parallel_dims.get_mesh("batch")
            )
        else:
            global_valid_tokens = local_valid_tokens.to(self.device)
        # trainer.py:908-929 -- move to device, hand lists to forward_backward_step,
        # which dispatches to pp_forward_backward_step (trainer.py:789-795).
        input_dict_mbs, label_mbs = [], []
        for input_dict, labels in microbatches:
            for key, value in input_dict.items():
                if isinstance(value, torch.Tensor):
                    input_dict[key] = value.to(self.device)
            input_dict_mbs.append(input_dict)
            label_mbs.append(labels.to(self.device))
        loss = self.forward_backward_step(
            input_dict=input_dict_mbs, labels=label_mbs, global_valid_tokens=global_valid_tokens
        )
        loss = loss.detach()
        # trainer.py:960-981 -- global loss = sum over the loss mesh when dp > 1
        if parallel_dims.dp_cp_enabled:
            loss_val = dist_utils.dist_sum(loss, parallel_dims.get_optional_mesh("loss"))
        else:
            loss_val = float(loss.sum().item())
        losses.append(float(loss_val) if self.pp_has_last_stage else None)
        if lr and steps > 1 and self.step < steps:
            with torch.no_grad():
                for m in self.model_parts:
                    for p in m.parameters():
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-lr)
        step_times.append(time.perf_counter() - ts)

    grads: dict[str, torch.Tensor | None] = {}
    missing = []
    for m in self.model_parts:
        for n, p in m.named_parameters():
            if p.grad is None:
                missing.append(_canon(n))
                # keep collectives aligned across the dp group
                grads[_canon(n)] = None
            else:
                grads[_canon(n)] = _as_f64(p.grad)
    eval_losses = None
    # after the gradients are read: an FSDP2 forward drops the sharded gradients of a root group that
    # a backward left (torch 2.13, without any pipeline); TorchTitan validates after its optimizer step
    if evaluate:  # as TorchTitan's validator calls it (components/validate.py:304-311), models in eval mode
        for m in self.model_parts:
            m.eval()
        arg_mbs, kwarg_mbs = [], []
        target_mbs = [] if self.pp_has_last_stage else None
        for input_dict, labels in _local_microbatches(batch_rank, seed, dp):
            inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels)
            if self.pp_has_first_stage:
                arg_mbs.append((inputs,))
            kwarg_mbs.append(extra_kwargs)
            if target_mbs is not None:
                target_mbs.append(labels)
        with self.train_context():
            eval_losses = [] if self.pp_has_last_stage else None
            self.pp_schedule.eval(arg_mbs=arg_mbs if self.pp_has_first_stage else None, kwarg_mbs=kwarg_mbs,
                                  target_mbs=target_mbs, losses=eval_losses)
        eval_losses = [None if v is None else float(v) for v in eval_losses] if eval_losses is not None else None
    return {
        "losses": losses,
        "grads": grads,
        "eval_losses": eval_losses,
        "info": {
            "rank": rank,
            "stages": [s.stage_index for s in _stages_of(self.pp_schedule)],
            "has_first": self.pp_has_first_stage,
            "has_last": self.pp_has_last_stage,
            "schedule_class": _qualified(type(getattr(self.pp_schedule, "_schedule", self.pp_schedule))),
            "stage_class": _qualified(type(_stages_of(self.pp_schedule)[0])),
            "step_adapter": isinstance(self.pp_schedule, _TorchStepAdapter),
            "missing_grads": missing,
            "import_s": t_start - t_enter,
            "build_s": t_built - t_start,
            "trainer_imports_skipped": st.get("trainer_import_skipped", []),
            "step_s": step_times,
            "spmd_backend": config.parallelism.spmd_backend,
            "device": str(self.device),
        },
    }


class _TorchStepAdapter:
    """Gives a torch-2.13 schedule the keyword form of step() that TorchTitan 0.3.0
    calls (trainer.py:856-863): pre-split microbatches. It does what torch 2.13's
    own step() does (schedules.py: set stage.has_backward, clear_runtime_states)
    and then calls torch's _step_microbatches with the caller's microbatches
    instead of splitting a whole batch. Everything else is delegated."""

    def __init__(self, schedule):
        object.__setattr__(self, "_schedule", schedule)

    def __getattr__(self, name):
        return getattr(self._schedule, name)

    def __setattr__(self, name, value):
        setattr(self._schedule, name, value)

    def step(self, *args, target=None, losses=None, return_outputs=True, loss_kwargs=None,
             arg_mbs=None, kwarg_mbs=None, target_mbs=None, **kwargs):
        s = self._schedule
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return s.step(*args, target=target, losses=losses, return_outputs=return_outputs,
                          loss_kwargs=loss_kwargs, **kwargs)
        if args or kwargs or target is not None:
            raise TypeError("pass either a batch or its microbatches, not both")
        stages = _stages_of(s)
        for stage in stages:
            stage.has_backward = s._has_backward
        for stage in stages:
            stage.clear_runtime_states()
        s._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        return None


def _adapt_schedule(schedule):
    import inspect

    if "arg_mbs" in inspect.signature(schedule.step).parameters:
        return schedule
    return _TorchStepAdapter(schedule)


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__name__}"


def _stages_of(schedule) -> list:
    if hasattr(schedule, "_stages"):
        return list(schedule._stages)
    return [schedule._stage]


# --------------------------------------------------------------------------
# reference(): one process, whole model, no pipeline / FSDP / AC
# --------------------------------------------------------------------------
def reference(dp: int = 1, *, seed: int = DEFAULT_SEED, dtype: str = "float64") -> dict:
    """One process, the whole model (no pipeline, FSDP2 or checkpointing), the same weights, global batch
    and loss: each microbatch's loss is TorchTitan's chunked cross entropy over global_valid_tokens, the
    step's loss their sum over every replica's microbatches (pp_forward_backward_step sums them,
    trainer.py:866-868; its schedules run with scale_grads=False). Also the eval losses (the loss without
    global_valid_tokens, the model in eval mode) per replica, as `run(evaluate=True)` gets them."""
    _setup_torchtitan()
    from torchtitan.components.loss import IGNORE_INDEX

    config = _trainer_config("1F1B", dp, None, 1, seed, dtype, None, "none")
    config.model_spec.model.update_from_config(config=config)
    model = _build_whole_model(config, seed)
    model.train()
    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)  # the chunked loss applies the head (trainer.py:527-535)
    model._skip_lm_head = True
    replicas = [_local_microbatches(r, seed, dp) for r in range(dp)]
    valid_tokens = sum(int((labels != IGNORE_INDEX).sum()) for mbs in replicas for _, labels in mbs)
    valid_tokens = torch.tensor(valid_tokens, dtype=torch.int64)
    totals = []
    for mbs in replicas:
        losses = []
        for input_dict, labels in mbs:
            loss, _ = loss_fn(model(input_dict["input"], positions=input_dict["positions"]), labels, valid_tokens)
            loss.backward()
            losses.append(loss.detach())
        totals.append(torch.sum(torch.stack(losses)))  # as trainer.py:868
    grads = {n: (None if p.grad is None else p.grad.detach().to(torch.float64).clone())
             for n, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        eval_losses = [[float(loss_fn(model(d["input"], positions=d["positions"]), labels)[0]) for d, labels in mbs]
                       for mbs in replicas]
    return {"losses": [float(torch.sum(torch.stack(totals)))], "grads": grads, "eval_losses": eval_losses}


def write_csv(path: str, n_stages: int = 2 * PP, n_mb: int = LOCAL_BATCH // MICROBATCH, pp: int = PP) -> str:
    """A user's compute-only CSV in torch's format for the Interleaved1F1B layout (stage s on rank s % pp):
    each rank's forwards stage by stage, then its full backwards in reverse (torch's LoopedBFS order)."""
    from torch.distributed.pipelining.schedules import B, F, _Action

    with open(path, "w") as f:
        for rank in range(pp):
            stages = [s for s in range(n_stages) if s % pp == rank]
            actions = [_Action(s, F, mb) for s in stages for mb in range(n_mb)]
            actions += [_Action(s, B, mb) for s in reversed(stages) for mb in range(n_mb)]
            f.write(",".join(str(a) for a in actions) + "\n")
    return path


def titan(rank: int, world: int, api: str, runs: list[dict], reference_dp: int | None = None) -> dict:
    """TorchTitan's pipeline training on this rank, in a process of its own (tests/dist_pool.run_fresh):
    on pipecore after `pipecore.compat.patch_torch_pipelining()` (api "pipecore"), or on torch's runtime.
    `runs`: run()'s keyword arguments, one run each ("csv": True writes write_csv's schedule). A run that
    raises ends the list (its error is recorded: the other ranks then see this process end). Rank 0 also
    computes the one-process reference for `reference_dp`."""
    import tempfile

    patch = None
    if api == "pipecore":
        import pipecore.compat

        patch = pipecore.compat.patch_torch_pipelining
    out: dict = {"runs": [], "reference": None}
    with tempfile.TemporaryDirectory() as folder:
        for options in runs:
            options = dict(options)
            csv = options.pop("csv", False)
            path = write_csv(os.path.join(folder, "schedule.csv")) if csv else None  # each rank its own copy
            try:
                result = run(rank, world, csv_path=path, patch=patch, **options)
                out["runs"].append(result)
            except Exception as exc:  # noqa: BLE001 - torch's runtime fails some on purpose
                said = str(exc).strip()
                out["runs"].append({"error": f"{type(exc).__name__}: {said}"})
                return out
            patch = None  # once per process
    if rank == 0 and reference_dp is not None:
        out["reference"] = reference(reference_dp)
    return out
