"""TorchTitan 0.3.0's own pipeline code, driven on CPU ranks as its Trainer drives it (a real client
nobody here wrote): a model from its own builders (its llama3, deepseek_v3 or qwen3-MoE, shrunk, in
`MODELS`) split by `pipeline_llm` (each model's parallelize function: selective activation
checkpointing and FSDP2 even at dp=1), its schedule builder, its chunked loss, its optimizer
container (AdamW, its learning-rate schedule, the MoE load-balancing hook its MoE models register)
and its `Trainer.train_step` with the methods it calls, compiled unedited from its trainer.py: the
gradient accumulation over `gradient_accumulation_steps` calls of `pp_forward_backward_step`, the
gradient clipping across stages, the optimizer step. On pipecore it runs after the one line
`pipecore.compat.patch_torch_pipelining()`; on torch's runtime without it. The one-process reference
is TorchTitan's non-pipeline path of the same `train_step` (`forward_backward_step`'s other branch).

What is not TorchTitan's, and why:
- its device is set to "cpu" before it is imported (it takes "cuda" when it finds no accelerator), and
  float64 is added to its dtype table in memory, so that the models, their weights and gradients are
  float64 (below: where TorchTitan itself rounds to float32);
- trainer.py itself cannot be imported here (its metrics and validator import tensorboard and
  datasets): the methods it runs are compiled from its source, with its own imports; the metrics
  processor and checkpointer train_step calls are stand-ins that keep what it logs and do nothing;
- FlexAttention (compiled) is swapped for its own causal SDPA attention;
- the MoE models' grouped experts run in the model's dtype (`_experts_in_model_dtype`): TorchTitan
  0.3.0 rounds every operand of its grouped GEMMs to bf16 (models/common/moe.py
  GroupedExperts.forward, with no switch), and torch's CPU `_grouped_mm` has no float64;
- every rank's weights are overwritten with one seeded whole model's (it seeds each pipeline rank
  differently), so one process can be the reference; the reference is not parallelized (no FSDP2, no
  checkpointing: neither changes the numbers of one process) and its batches are single rows
  (local_batch_size 1, the same global batch, so `gradient_accumulation_steps` is the number of
  rows), so that each row's forward and backward is the pipeline's, operation for operation (see
  `reference`);
- the gradients are read between `forward_backward_step` calls and before the clipping by a wrapper
  around that method (`_observe_accumulation`), which only copies them;
- torch 2.13's `step()` lacks the keyword form trainer.py calls (TorchTitan 0.3.0 targets a newer
  torch): on torch's runtime only, `_TorchStepAdapter` calls torch's own `_step_microbatches`.

Where TorchTitan itself computes in float32 in a float64 run, by its own casts: its cross entropy
(`.float()` on the logits, components/loss.py:61), its chunked loss's sum and the gradient it hands the
hidden states (float32 buffers, loss.py:700-711), and the MoE dispatcher's weighting of each expert's
output (`.to(torch.float32)`, models/common/token_dispatcher.py:159); the router's float32 autocast
(moe.py:298) is ignored on CPU (it warns), so the gate runs in float64. Each of these rounds one row's
values, which both sides compute with the same operations on the same numbers, so every gradient and
weight still agrees within the float64 bound; the losses themselves are float32, and the step's loss is a
float32 sum over the rows in another order (tests/test_torchtitan.py `_loss_bound`).

Adapted from a driver written for issue 49 (2 gloo ranks: dim 64, 4 layers, vocab 256, 32 tokens, 8
microbatches of 1); the MoE models and the accumulation come from issue 58.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import itertools
import os
import sys
import time
import types
import warnings
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
TRAINING_STEPS = 10  # training.steps of TorchTitan's debug configs: the run its learning-rate schedule plans

SCHEDULES = ["1F1B", "Interleaved1F1B", "ZBVZeroBubble", "InterleavedZeroBubble", "DualPipeV"]

_TRAINER_METHODS = ("post_dataloading_process", "forward_backward_step", "pp_forward_backward_step",
                    "_forward_backward_body", "train_step")

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
    # the MoE router's torch.autocast(dtype=torch.float32) (models/common/moe.py:298) warns on every CPU
    # forward that it is ignored (the gate runs in the model's dtype)
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")

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
    optimizer: Any
    lr_scheduler: Any
    dump_folder: str = "./outputs"


def _trainer_py_path() -> str:
    spec = importlib.util.find_spec("torchtitan")
    assert spec is not None and spec.submodule_search_locations
    return os.path.join(list(spec.submodule_search_locations)[0], "trainer.py")


def _load_trainer_methods() -> dict[str, Callable]:
    """Compile Trainer.{post_dataloading_process, forward_backward_step, pp_forward_backward_step,
    _forward_backward_body, train_step} straight from trainer.py's source.

    The namespace is built by executing trainer.py's own top-level import
    statements one by one (those that fail here, e.g. metrics -> tensorboard,
    are skipped; none of these methods use them)."""
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
# Models: TorchTitan's debug models shrunk, built with each package's own builders
# --------------------------------------------------------------------------
MODELS = ("llama3", "deepseek_v3", "qwen3_moe")

# The MoE models' routing, as their debug flavors route (deepseek_v3 "debugmodel": 8 experts, top 3, 2
# shared experts, layer 0 dense; qwen3 "debugmodel_moe" routes to 8 of 64 experts: here 2 of 8).
MOE_EXPERTS = 8
MOE_HIDDEN = 32


def _sdpa(layers) -> None:
    """get_attention_config("sdpa") deliberately raises for language models in 0.3.0, so layers are built
    with the "flex" config and each inner_attention config is then swapped for TorchTitan's
    ScaledDotProductAttention.Config() (causal SDPA)."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()


def _llama3_model():
    """models/llama3/__init__.py `_debugmodel` with dim 64 / 4 layers / vocab 256."""
    import torchtitan.models.llama3 as L
    from torchtitan.models.common import ComplexRoPE, compute_ffn_hidden_dim, Embedding, Linear, RMSNorm

    layers = L._build_llama3_layers(
        fuse_qkv=True,
        n_layers=N_LAYERS,
        dim=DIM,
        n_heads=N_HEADS,
        hidden_dim=compute_ffn_hidden_dim(DIM, multiple_of=256),
        rope=ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=131072, theta=500000, scaling="llama"),
        attn_backend="flex",
    )
    _sdpa(layers)
    return L.Llama3Model.Config(
        dim=DIM,
        vocab_size=VOCAB,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=L._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=L._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=L._output_linear_init(DIM)),
        layers=layers,
    )


def _deepseek_v3_model():
    """models/deepseek_v3/__init__.py `_debugmodel` (MLA attention without q LoRA, yarn RoPE, layer 0 a
    dense feed-forward, the others MoE with shared experts, softmax top-3 routing, no MTP layers) with
    dim 64 / 4 layers / vocab 256 / 4 heads and MLA's widths divided by 8."""
    import torchtitan.models.deepseek_v3 as D
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm

    rope_dim = 8
    layers = D._build_dsv3_layers(
        n_layers=N_LAYERS,
        n_dense_layers=1,
        dim=DIM,
        n_heads=N_HEADS,
        q_lora_rank=0,
        kv_lora_rank=64,
        qk_nope_head_dim=16,
        qk_rope_head_dim=rope_dim,
        v_head_dim=16,
        mscale=0.70,
        dense_hidden_dim=4 * DIM,
        moe_hidden_dim=MOE_HIDDEN,
        num_experts=MOE_EXPERTS,
        num_shared_experts=2,
        router_top_k=3,
        router_score_func="softmax",
        attn_backend="flex",
        moe_comm_backend="standard",
        non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=rope_dim, max_seq_len=4096 * 4, theta=10000.0, scaling="yarn", rope_factor=40.0,
                                beta_fast=32.0, beta_slow=1.0, original_seq_len=4096),
    )
    _sdpa(layers)
    return D.DeepSeekV3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=D._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=DIM, param_init=D._NORM_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=D._output_linear_init(DIM)),
        layers=layers,
        mtp_layers=[],
    )


def _qwen3_moe_model():
    """models/qwen3/__init__.py `_debugmodel_moe` (GQA with q/k norms, every layer MoE, softmax routing with
    route_norm, no shared experts, untied head) with dim 64 / 4 layers / vocab 256 / 4 heads of 16, 2 kv
    heads, 8 experts, top 2."""
    import torchtitan.models.qwen3 as Q
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear

    head_dim = DIM // N_HEADS
    layers = Q._build_qwen3_moe_layers(
        fuse_qkv=True,
        n_layers=N_LAYERS,
        dim=DIM,
        n_heads=N_HEADS,
        n_kv_heads=N_HEADS // 2,
        head_dim=head_dim,
        moe_hidden_dim=MOE_HIDDEN,
        num_experts=MOE_EXPERTS,
        top_k=2,
        attn_backend="flex",
        rope=CosSinRoPE.Config(dim=head_dim, max_seq_len=4096, theta=1000000.0),
        moe_comm_backend="standard",
    )
    _sdpa(layers)
    return Q.Qwen3Model.Config(
        vocab_size=VOCAB,
        dim=DIM,
        norm=Q._qwen3_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM, param_init=Q._EMBEDDING_INIT),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=Q._LINEAR_INIT),
        layers=layers,
    )


# name: (package, flavor whose registry entry gives the parallelize/pipelining/post-optimizer functions,
# the shrunk model, optimizer learning rate, lr_scheduler) -- the last two as each model's debug config in its
# config_registry.py sets them (llama3_debugmodel, deepseek_v3_debugmodel, qwen3_moe_debug), all with
# default_adamw (AdamW, betas (0.9, 0.95), eps 1e-8, weight decay 0.1); config_registry.py itself imports
# TorchTitan's data loaders and the real Trainer.Config, so the values are copied.
_FAMILIES = {
    "llama3": ("torchtitan.models.llama3", "debugmodel", _llama3_model, 8e-4,
               dict(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)),
    "deepseek_v3": ("torchtitan.models.deepseek_v3", "debugmodel", _deepseek_v3_model, 8e-4,
                    dict(warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0)),
    "qwen3_moe": ("torchtitan.models.qwen3", "debugmodel_moe", _qwen3_moe_model, 3e-4, dict(warmup_steps=2)),
}


def gradient_terms(accumulate: int = 1, dp: int = 1) -> int:
    """The longest chain of sums behind one gradient entry of any of MODELS, for exactness's float64 bound
    (exactness.transformer_terms): the step's tokens (every accumulation group, every replica), and per
    block the widest sums any of them has: 4 x DIM for a feed-forward (llama3's is 256 = 4 x DIM after
    compute_ffn_hidden_dim's rounding to a multiple of 256, deepseek_v3's dense layer 4 x DIM, an expert's
    MOE_HIDDEN and the router's softmax over MOE_EXPERTS less), DIM for the projections and norms
    (deepseek_v3's kv LoRA rank is DIM as well), a head's width of 24 (deepseek_v3's 16 + 8 rotary; 16
    for the others)."""
    from exactness import transformer_terms

    return transformer_terms(tokens=accumulate * dp * LOCAL_BATCH * SEQ, width=DIM, mlp_width=4 * DIM,
                             layers=N_LAYERS, head_width=24, seq_len=SEQ, vocab=VOCAB)


def _experts_class():
    """TorchTitan's GroupedExperts with its SwiGLU in the model's dtype (made once, after the import)."""
    if "experts_class" in _STATE:
        return _STATE["experts_class"]
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor
    from torchtitan.models.common.moe import GroupedExperts

    class ModelDtypeGroupedExperts(GroupedExperts):
        """GroupedExperts.forward's computation, silu(x w1^T) * (x w3^T) w2^T over each expert's rows (in
        the dispatcher's expert order), with the weights and rows in the model's dtype instead of bf16."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(GroupedExperts.Config):
            pass

        def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
            w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                          for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
            rows = torch.split(x_RD, num_tokens_per_expert_E.tolist())
            return torch.cat([(F.silu(x @ w1[e].T) * (x @ w3[e].T)) @ w2[e].T for e, x in enumerate(rows)])

    _STATE["experts_class"] = ModelDtypeGroupedExperts
    return ModelDtypeGroupedExperts


def _experts_in_model_dtype(model_config):
    """Swap every GroupedExperts config for `_experts_class()`'s, the way TorchTitan's own converters swap
    expert classes (components/quantization/mx.py MXFP8GroupedExpertsConverter.convert)."""
    from torchtitan.models.common.moe import GroupedExperts

    cls = _experts_class()
    for _fqn, config, parent, attr in list(model_config.traverse(GroupedExperts.Config)):
        new_config = cls.Config(**{f.name: getattr(config, f.name) for f in dataclasses.fields(config)})
        if isinstance(parent, list):
            parent[attr] = new_config
        else:
            setattr(parent, attr, new_config)
    return model_config


def _model_spec(model: str = "llama3", experts: str = "model dtype"):
    """The package's own registry entry for its debug flavor (its parallelize_fn, pipelining_fn =
    pipeline_llm, post_optimizer_build_fn = the MoE load-balancing hook for the MoE models), with the
    shrunk model config. `experts`: "model dtype" (`_experts_in_model_dtype`) or "bf16" (TorchTitan's
    own GroupedExperts)."""
    import importlib

    package, flavor, build, _lr, _schedule = _FAMILIES[model]
    spec = importlib.import_module(package).model_registry(flavor)
    spec.model = build()
    spec.flavor = f"{flavor}_tiny_sdpa"
    if experts == "model dtype":
        spec.model = _experts_in_model_dtype(spec.model)
    else:
        assert experts == "bf16", experts
    return spec


def _trainer_config(schedule: str, dp: int, csv_path: str | None, seed: int, dtype: str, spmd_backend: str | None,
                    ac: str, *, model: str = "llama3", accumulate: int = 1, layers_per_stage: int | None = None,
                    experts: str = "model dtype", pp: int = PP, tp: int = 1, sequence_parallel: bool = True,
                    parts: list[list[str]] | None = None):
    """Trainer.Config as each model's debug config builds it (llama3_debugmodel, config_registry.py:34-70),
    shrunk, float32/64 everywhere (no bf16), PP=2; `accumulate` optimizer-step batches of
    `accumulate` x dp x local_batch_size rows (training.global_batch_size: gradient_accumulation_steps is
    `accumulate`). `pp`=1: TorchTitan's non-pipeline path, which the reference drives with batches of
    single rows (local_batch_size = the pipeline's microbatch size) and the same global batch. `tp`:
    parallelism.tensor_parallel_degree (its enable_sequence_parallel: `sequence_parallel`); `parts`: its
    module_fqns_per_model_part (an uneven split)."""
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
    from torchtitan.models.common.config_utils import decoder_vocab_size

    st = _setup_torchtitan()
    model_spec = _model_spec(model, experts)
    _package, _flavor, _build, lr, lr_schedule = _FAMILIES[model]
    local_batch = LOCAL_BATCH if pp > 1 else MICROBATCH
    training = TrainingConfig(
        local_batch_size=local_batch,
        global_batch_size=accumulate * dp * LOCAL_BATCH,
        seq_len=SEQ,
        steps=TRAINING_STEPS,
        dtype=dtype,
        # FSDP MixedPrecisionPolicy(param_dtype, reduce_dtype): keep the model dtype.
        mixed_precision_param=dtype,
        mixed_precision_reduce=dtype,
        # Trainer.Config._validate_cuda_graphs: PP requires this.
        disable_cuda_graphs=True,
    )
    par_kwargs = dict(
        pipeline_parallel_degree=pp,
        data_parallel_shard_degree=dp if pp > 1 else 1,
        pipeline_parallel_schedule=schedule,
        pipeline_parallel_schedule_csv=csv_path or "",
        pipeline_parallel_microbatch_size=MICROBATCH,
        pipeline_parallel_layers_per_stage=layers_per_stage,
        tensor_parallel_degree=tp if pp > 1 else 1,
        enable_sequence_parallel=sequence_parallel,
        module_fqns_per_model_part=parts,
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
        optimizer=default_adamw(lr=lr),
        lr_scheduler=LRSchedulersContainer.Config(**lr_schedule),
    )
    if st["trainer_importable"]:
        from torchtitan.trainer import Trainer

        return Trainer.Config(**fields)
    return _StandInTrainerConfig(**fields)


# --------------------------------------------------------------------------
# Data: fixed batches, identical on every rank
# --------------------------------------------------------------------------
def _global_batch(dp: int, seed: int, accumulate: int = 1, step: int = 0):
    """Token ids for one optimizer step's (accumulate * dp * local_batch) rows from a seeded generator,
    with per-row positions (one document per row, as the dataloader emits `{"input", "positions"}`) and
    a few IGNORE_INDEX labels so that global_valid_tokens != numel. Rows (g * dp + r) * local_batch + i:
    accumulation group g of replica r."""
    from torchtitan.components.loss import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed + 99 + step)
    rows = accumulate * dp * LOCAL_BATCH
    toks = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    inputs, labels = toks[:, :-1].clone(), toks[:, 1:].clone()
    labels[1::3, -3:] = IGNORE_INDEX
    positions = torch.arange(SEQ).unsqueeze(0).expand(rows, SEQ).contiguous()
    return inputs, labels, positions


def _local_microbatches(dp_rank: int, seed: int, dp: int, accumulate: int = 1, step: int = 0, groups=None):
    """What the dataloader hands one dp replica for one optimizer step, in order: each accumulation
    group's local_batch rows (or only `groups`'), as microbatches of pipeline_parallel_microbatch_size
    (trainer.py:570-574 dataloader batch size, 885-892)."""
    inputs, labels, positions = _global_batch(dp, seed, accumulate, step)
    mbs = []
    for group in range(accumulate) if groups is None else groups:
        lo = (group * dp + dp_rank) * LOCAL_BATCH
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


def _gradients(model_parts) -> dict[str, torch.Tensor | None]:
    """Every parameter's .grad (None stays None) by its whole-model name, in float64 (in module order on
    every rank: full_tensor() is a collective over the dp group)."""
    return {_canon(n): None if p.grad is None else _as_f64(p.grad)
            for m in model_parts for n, p in m.named_parameters()}


def _weights(model_parts) -> dict[str, torch.Tensor]:
    return {_canon(n): _as_f64(p) for m in model_parts for n, p in m.named_parameters()}


def _shared_fsdp_states(model_parts) -> list[list[str]]:
    """The modules of each FSDP2 state that several modules reach (one fully_shard over a list of
    modules, as apply_fsdp_to_decoder shards [norm, lm_head]), by name."""
    from torch.distributed.fsdp import FSDPModule

    units: dict[int, list[str]] = {}
    for m in model_parts:
        for name, sub in m.named_modules():
            if isinstance(sub, FSDPModule):
                units.setdefault(id(sub._get_fsdp_state()), []).append(_canon(name))
    return sorted(names for names in units.values() if len(names) > 1)


def _expert_biases(model_parts) -> dict[str, torch.Tensor]:
    """The MoE load-balancing biases, which TorchTitan's hook updates before each optimizer step."""
    return {_canon(n): b.detach().to(torch.float64).clone() for m in model_parts for n, b in m.named_buffers()
            if n.endswith("expert_bias_E")}


# --------------------------------------------------------------------------
# The Trainer stand-in: Trainer.__init__'s steps for this run, TorchTitan's methods bound to it
# --------------------------------------------------------------------------
class _Metrics:
    """The two calls train_step makes to its MetricsProcessor (should_log at log_freq 1, as every debug
    config sets it, and log): what it would log is kept."""

    def __init__(self):
        self.logged: list[dict] = []

    def should_log(self, step: int) -> bool:
        return True

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        self.logged.append({"step": step, "loss": global_avg_loss, "max_loss": global_max_loss,
                            "grad_norm": grad_norm, **(extra_metrics or {})})


def _trainer(config, world: int, rank: int, seed: int, methods: dict[str, Callable]) -> types.SimpleNamespace:
    """What Trainer.__init__ sets up that train_step, forward_backward_step and the validator's pipeline
    branch use, in its order (the line numbers are trainer.py's), on `world` ranks: with
    parallelism.pipeline_parallel_degree > 1 the pipeline (pipelining_fn with parallelize_fn), otherwise
    the whole model (TorchTitan's non-pipeline path, without parallelize_fn, see the module docstring)."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed import ParallelDims, utils as dist_utils
    from torchtitan.tools import utils

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
    pipeline = parallel_dims.pp_enabled
    # trainer.py:319
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)
    # trainer.py:325-330
    if parallel_dims.dp_enabled:
        batch_mesh = parallel_dims.get_mesh("batch")
        batch_degree, self.batch_rank = batch_mesh.size(), batch_mesh.get_local_rank()
    else:
        batch_degree, self.batch_rank = 1, 0
    # trainer.py:337-342 -- seeds (distinct per pp rank, so per-stage init differs;
    # the reference weights are copied in below).
    if pipeline:
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
    global_batch_size = config.training.global_batch_size
    if global_batch_size < 0:
        global_batch_size = config.training.local_batch_size * batch_degree
    assert global_batch_size % (config.training.local_batch_size * batch_degree) == 0
    self.gradient_accumulation_steps = global_batch_size // (config.training.local_batch_size * batch_degree)
    self.num_pipeline_parallel_microbatches = (
        config.training.local_batch_size // config.parallelism.pipeline_parallel_microbatch_size if pipeline else 1
    )
    if pipeline:
        # trainer.py:442-485 -- pipelining_fn (= pipeline_llm) with parallelize_fn (e.g.
        # parallelize_llama: SelectiveAC + FSDP2) and the loss; it builds the schedule through
        # _build_pipeline_schedule.
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
    else:
        # trainer.py:491-507 without parallelize_fn (the reference: one process, no FSDP2, no checkpointing)
        self.model_parts = [model]
        self.pp_has_first_stage = self.pp_has_last_stage = True
    for m in self.model_parts:  # trainer.py:473-479
        m.to_empty(device=init_device)
        with torch.no_grad():
            m.init_weights(buffer_device=buffer_device)
        m.train()
    # NOT Trainer: overwrite every parameter with the seeded whole-model weights
    # so all ranks/stages and the one-process reference agree.
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
    # trainer.py:513-535 -- the chunked loss gets the (last stage's) lm_head; the model then skips
    # lm_head in forward.
    if isinstance(self.loss_fn, ChunkedLossWrapper) and self.pp_has_last_stage:
        lm_head = self.model_parts[-1].lm_head
        assert lm_head is not None
        self.loss_fn.set_lm_head(lm_head)
        self.model_parts[-1]._skip_lm_head = True
    # trainer.py:549-559 -- optimizers, the model's post-optimizer hook (the MoE load balancing), the
    # learning-rate schedule
    self.optimizers = config.optimizer.build(model_parts=self.model_parts)
    if model_spec.post_optimizer_build_fn is not None:
        model_spec.post_optimizer_build_fn(self.optimizers, self.model_parts, parallel_dims)
    self.lr_schedulers = config.lr_scheduler.build(optimizers=self.optimizers, training_steps=config.training.steps)
    # NOT Trainer: what train_step logs is kept; no checkpoint is staged
    self.metrics_processor = _Metrics()
    self.checkpointer = types.SimpleNamespace(maybe_wait_for_staging=lambda: None)
    # trainer.py:563-564
    self.step = 0
    self.ntokens_seen = 0
    # trainer.py:605-612
    self.train_context = dist_utils.get_spmd_context(
        parallel_dims=parallel_dims,
        spmd_typechecking=(config.parallelism.spmd_backend == "spmd_types" and config.debug.spmd_typechecking),
    )
    # Bind TorchTitan's own methods to the stand-in.
    for name, fn in methods.items():
        setattr(self, name, types.MethodType(fn, self))
    self.fwd_bwd_fn = self._forward_backward_body  # trainer.py:612 (no CUDA graphs)
    return self


def _observe_accumulation(self, calls_per_group: int) -> None:
    """Wrap TorchTitan's forward_backward_step (which train_step calls gradient_accumulation_steps times
    before it clips and steps) to copy every gradient after each `calls_per_group` calls: after each
    accumulation group of the pipeline's (one call each), after as many single rows for the reference."""
    forward_backward_step = self.forward_backward_step
    calls = itertools.count(1)
    self.grads_by_group = []

    def observed(**kwargs):
        loss = forward_backward_step(**kwargs)
        if next(calls) % calls_per_group == 0:
            self.grads_by_group.append(_gradients(self.model_parts))
        return loss

    self.forward_backward_step = observed


def _train(self, steps: int, batches: Callable[[int], list]) -> dict:
    """`steps` calls of TorchTitan's train_step (trainer.py:1040-1050 sets self.step first), each on the
    iterator over `batches(step)`; what it logged, the gradients after each accumulation group and the
    weights and MoE biases after the optimizer."""
    losses, grad_norms, lrs, step_times = [], [], [], []
    for step in range(steps):
        self.step += 1
        ts = time.perf_counter()
        self.train_step(iter(batches(step)))
        step_times.append(time.perf_counter() - ts)
        logged = self.metrics_processor.logged[-1]
        # a rank without the last stage logs -1 per group (pp_forward_backward_step, trainer.py:866-869)
        losses.append(float(logged["loss"]) if self.pp_has_last_stage else None)
        grad_norms.append(float(logged["grad_norm"]))
        lrs.append([v for k, v in logged.items() if k.startswith("lr/")])
    return {"losses": losses, "grad_norms": grad_norms, "lrs": lrs, "step_s": step_times,
            "grads_by_group": self.grads_by_group, "grads": self.grads_by_group[-1],
            "weights": _weights(self.model_parts), "expert_biases": _expert_biases(self.model_parts)}


# --------------------------------------------------------------------------
# run(): one rank of the pipeline, driven like Trainer.__init__ + train_step
# --------------------------------------------------------------------------
def run(rank: int, world: int, schedule: str, dp: int = 1, csv_path: str | None = None, steps: int = 1,
        patch: Callable[[], Any] | None = None, *, seed: int = DEFAULT_SEED, dtype: str = "float64",
        spmd_backend: str | None = None, ac: str = "selective", evaluate: bool = False, model: str = "llama3",
        accumulate: int = 1, layers_per_stage: int | None = None, experts: str = "model dtype", tp: int = 1,
        sequence_parallel: bool = True, parts: list[list[str]] | None = None) -> dict:
    """Run `steps` of TorchTitan's Trainer.train_step on this rank, each `accumulate` calls of
    pp_forward_backward_step (gradient_accumulation_steps) before its clipping and optimizer step.

    Must be called inside an initialised gloo process group with world == PP * dp * tp (`tp`, `sequence_parallel`,
    `parts`: _trainer_config's).
    `schedule` is TorchTitan's parallelism.pipeline_parallel_schedule; with
    `csv_path` it still decides the stage layout (stages/rank, loop vs V) while
    the CSV decides the order (TorchTitan then uses _PipelineScheduleRuntime).
    `layers_per_stage`: parallelism.pipeline_parallel_layers_per_stage.
    Returns {"losses": [float|None per step], "grads": {fqn: float64 CPU tensor or None} after the last
    step's accumulation, "grads_by_group": the same after each group, "weights" after the last optimizer
    step, "grad_norms", "expert_biases", "eval_losses", "info": {...}}.
    """
    t_enter = time.perf_counter()
    if patch is not None:
        patch()  # before ANY torchtitan import (it may alias torch.distributed.pipelining)
    st = _setup_torchtitan()
    methods = _load_trainer_methods()

    import torch.distributed as dist

    assert dist.is_initialized(), "run() expects an initialised process group"
    assert world == dist.get_world_size() == PP * dp * tp, (world, dist.get_world_size(), dp, tp)
    t_start = time.perf_counter()

    config = _trainer_config(schedule, dp, csv_path, seed, dtype, spmd_backend, ac, model=model,
                             accumulate=accumulate, layers_per_stage=layers_per_stage, experts=experts, tp=tp,
                             sequence_parallel=sequence_parallel, parts=parts)
    self = _trainer(config, world, rank, seed, methods)
    _observe_accumulation(self, 1)
    t_built = time.perf_counter()
    out = _train(self, steps, lambda step: _local_microbatches(self.batch_rank, seed, dp, accumulate, step))
    missing = sorted(n for n, g in out["grads"].items() if g is None)
    eval_losses = None
    # TorchTitan validates after its optimizer step (an FSDP2 forward also drops the sharded gradients of a
    # root group that a backward left, torch 2.13, without any pipeline)
    if evaluate:  # as TorchTitan's validator calls it (components/validate.py:283-311), models in eval mode
        for m in self.model_parts:
            m.eval()
        arg_mbs, kwarg_mbs = [], []
        target_mbs = [] if self.pp_has_last_stage else None
        for input_dict, labels in _local_microbatches(self.batch_rank, seed, dp, accumulate, groups=[0]):
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
    stages = _stages_of(self.pp_schedule)
    return {
        **out,
        "eval_losses": eval_losses,
        "info": {
            "rank": rank,
            "stages": [s.stage_index for s in stages],
            "n_stages": getattr(stages[0], "num_stages", None),
            "modules": [sorted({n.split(".")[0] if not n.startswith("layers.") else ".".join(n.split(".")[:2])
                                for n, _ in m.named_parameters()}) for m in self.model_parts],
            "has_first": self.pp_has_first_stage,
            "has_last": self.pp_has_last_stage,
            "gradient_accumulation_steps": self.gradient_accumulation_steps,
            "shared_fsdp_states": _shared_fsdp_states(self.model_parts),
            "schedule_class": _qualified(type(getattr(self.pp_schedule, "_schedule", self.pp_schedule))),
            "stage_class": _qualified(type(stages[0])),
            "step_adapter": isinstance(self.pp_schedule, _TorchStepAdapter),
            "missing_grads": missing,
            "import_s": t_start - t_enter,
            "build_s": t_built - t_start,
            "trainer_imports_skipped": st.get("trainer_import_skipped", []),
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
# reference(): one process, TorchTitan's non-pipeline path
# --------------------------------------------------------------------------
def reference(dp: int = 1, *, seed: int = DEFAULT_SEED, dtype: str = "float64", model: str = "llama3",
              accumulate: int = 1, steps: int = 1, experts: str = "model dtype") -> dict:
    """One process, the whole model (no pipeline, FSDP2 or checkpointing), the same weights, global batch
    and loss, through the same TorchTitan train_step as run() but its non-pipeline branch
    (forward_backward_step -> _forward_backward_body: the chunked cross entropy over global_valid_tokens,
    backward), with batches of one row each: every replica's rows of every accumulation group, so
    gradient_accumulation_steps = accumulate x dp x local_batch, and then its clipping, AdamW, the MoE
    hook and the learning-rate schedule. Row by row, each forward and backward is the pipeline's
    microbatch's, operation for operation; only the sums over rows (the gradients' accumulation, the
    loss's sum) and the clipping norm's sum are in another order. Also the eval losses after the optimizer
    step (the loss without global_valid_tokens, the model in eval mode, TorchTitan's validator's
    non-pipeline branch, components/validate.py:312-320) per replica, as `run(evaluate=True)` gets them."""
    _setup_torchtitan()
    methods = _load_trainer_methods()
    config = _trainer_config("1F1B", dp, None, seed, dtype, None, "none", model=model, accumulate=accumulate,
                             experts=experts, pp=1)
    self = _trainer(config, 1, 0, seed, methods)
    assert self.gradient_accumulation_steps == accumulate * dp * LOCAL_BATCH // MICROBATCH
    _observe_accumulation(self, dp * LOCAL_BATCH // MICROBATCH)
    out = _train(self, steps, lambda step: [mb for group in range(accumulate) for r in range(dp)
                                            for mb in _local_microbatches(r, seed, dp, accumulate, step, [group])])
    (model_,) = self.model_parts
    model_.eval()
    eval_losses = []
    with torch.no_grad(), self.train_context():
        for r in range(dp):
            losses = []
            for input_dict, labels in _local_microbatches(r, seed, dp, accumulate, groups=[0]):
                inputs, labels, extra_kwargs = self.post_dataloading_process(input_dict, labels)
                losses.append(float(self.loss_fn(model_(inputs, **extra_kwargs), labels)[0]))
            eval_losses.append(losses)
    return {**out, "eval_losses": eval_losses}


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


def titan(rank: int, world: int, api: str, runs: list[dict], reference_dp: int | dict | None = None) -> dict:
    """TorchTitan's pipeline training on this rank, in a process of its own (tests/dist_pool.run_fresh):
    on pipecore after `pipecore.compat.patch_torch_pipelining()` (api "pipecore"), or on torch's runtime.
    `runs`: run()'s keyword arguments, one run each ("csv": True writes write_csv's schedule). A run that
    raises ends the list (its error is recorded: the other ranks then see this process end). Rank 0 also
    computes the one-process reference: reference()'s keyword arguments, or its dp alone."""
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
        options = {"dp": reference_dp} if isinstance(reference_dp, int) else reference_dp
        out["reference"] = reference(**options)
    return out
