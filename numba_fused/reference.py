"""Composed float64 NumPy formulations: the ground truth for tests and the
"composed" baseline of the benchmark.

Every function widens its inputs to float64 (whatever their dtype) and returns
float64 results, so a test compares a kernel against the correctly computed
answer for the same (already quantized) inputs. Same argument order and
meaning as the public API.
"""
import numpy as np


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def softmax_fwd(x):
    """y = exp(x - max(x)) / sum(exp(x - max(x))) over the last axis."""
    x = _f64(x)
    with np.errstate(invalid='ignore', over='ignore'):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        return e / e.sum(axis=-1, keepdims=True)


def softmax_bwd(y, dy):
    """dx = y * (dy - sum(dy * y))."""
    y, dy = _f64(y), _f64(dy)
    return y * (dy - (dy * y).sum(axis=-1, keepdims=True))


def rms_norm_fwd(x, weight=None, eps=1e-6):
    """rstd = 1 / sqrt(mean(x**2) + eps); y = x * rstd * weight. Returns (y, rstd)."""
    x = _f64(x)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1) + eps)
    y = x * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    return y, rstd


def rms_norm_bwd(dy, x, weight, rstd):
    """With xhat = x * rstd and g = dy * weight:
    dx = rstd * (g - xhat * mean(g * xhat)); dweight = sum over rows of dy * xhat."""
    dy, x, rstd = _f64(dy), _f64(x), _f64(rstd)[..., None]
    xhat = x * rstd
    g = dy if weight is None else dy * _f64(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True))
    dweight = None if weight is None else (dy * xhat).reshape(-1, x.shape[-1]).sum(axis=0)
    return dx, dweight


def layer_norm_fwd(x, weight=None, bias=None, eps=1e-5):
    """mean, var (biased) over the last axis; rstd = 1 / sqrt(var + eps);
    y = (x - mean) * rstd * weight + bias. Returns (y, mean, rstd)."""
    x = _f64(x)
    mean = x.mean(axis=-1)
    centered = x - mean[..., None]
    rstd = 1.0 / np.sqrt((centered * centered).mean(axis=-1) + eps)
    y = centered * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    return y, mean, rstd


def layer_norm_bwd(dy, x, weight, bias, mean, rstd):
    """With xhat = (x - mean) * rstd and g = dy * weight:
    dx = rstd * (g - xhat * mean(g * xhat) - mean(g));
    dweight = sum over rows of dy * xhat; dbias = sum over rows of dy."""
    dy, x = _f64(dy), _f64(x)
    mean, rstd = _f64(mean)[..., None], _f64(rstd)[..., None]
    xhat = (x - mean) * rstd
    g = dy if weight is None else dy * _f64(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(axis=-1, keepdims=True)
                 - g.mean(axis=-1, keepdims=True))
    cols = x.shape[-1]
    dweight = None if weight is None else (dy * xhat).reshape(-1, cols).sum(axis=0)
    dbias = None if bias is None else dy.reshape(-1, cols).sum(axis=0)
    return dx, dweight, dbias
