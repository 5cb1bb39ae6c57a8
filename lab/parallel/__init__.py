"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA), applied to our decoder from the
outside: its weights are sharded in place (column- and row-parallel linears, vocab-parallel embedding
and head), so lab/models/decoder.py itself stays single-device.

Modules: distributed (process groups from torchrun's environment), layers (the parallel modules),
shard (cutting a DecoderModel's weights, a ModelRunner's config), serving (lockstep engine loops).
"""

from lab.parallel.distributed import ParallelContext, init_distributed
from lab.parallel.shard import shard_model, shard_runner

__all__ = ["ParallelContext", "init_distributed", "shard_model", "shard_runner"]
