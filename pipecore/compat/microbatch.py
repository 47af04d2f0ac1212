"""torch.distributed.pipelining.microbatch's chunk specs (torch's own: they are data that pipecore's
Pipeline passes to torch's splitter and merger)."""

from torch.distributed.pipelining.microbatch import (TensorChunkSpec, merge_chunks,  # noqa: F401
                                                     split_args_kwargs_into_chunks)

__all__ = ["TensorChunkSpec", "split_args_kwargs_into_chunks", "merge_chunks"]

from pipecore.compat._fallback import torch_fallback  # noqa: E402

__getattr__ = torch_fallback("torch.distributed.pipelining.microbatch", __name__)
