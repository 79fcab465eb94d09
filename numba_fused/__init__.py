"""numba_fused: fused softmax, RMSNorm and LayerNorm, forward and backward, on the
CPU (numba) and NVIDIA GPUs (numba-cuda). Reductions run over the last axis."""
from ._alloc import empty_like, pool_info, release_pool, set_pool_limit
from ._dispatch import (layer_norm, layer_norm_bwd, layer_norm_fwd, rms_norm,
                        rms_norm_bwd, rms_norm_fwd, softmax, softmax_bwd, softmax_fwd)

__version__ = "0.1.0"
__all__ = ["softmax_fwd", "softmax_bwd", "softmax", "rms_norm_fwd", "rms_norm_bwd",
           "rms_norm", "layer_norm_fwd", "layer_norm_bwd", "layer_norm", "empty_like",
           "set_pool_limit", "release_pool", "pool_info"]
