"""A stand-in for a second device on a CPU-only machine, to test which device each tensor of a
policy is on.

``OnDevice`` tensors are CPU tensors marked as living on "the device". An operation that mixes
a marked tensor with an unmarked one of one element or more raises, as CUDA raises on a mix of
CUDA and CPU tensors (0-dim CPU tensors, which CUDA accepts as scalars, are allowed). Results of
operations on marked tensors are marked; ``.cpu()``, ``.tolist()``, ``.item()`` and a ``.to``
naming a device give unmarked ones (the way back to the host). ``to_device`` marks a tensor (the
way up).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

_TO_HOST = {torch.Tensor.cpu, torch.Tensor.numpy}


class DeviceMixError(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        marked = [a for a in flat if isinstance(a, OnDevice)]
        plain = [a for a in flat if not isinstance(a, OnDevice) and a.dim() > 0]
        if marked and plain:
            raise DeviceMixError(f"{getattr(func, '__name__', func)}: device tensors mixed with "
                                 f"CPU tensors of shapes {[tuple(p.shape) for p in plain]}")
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func in _TO_HOST or (func is torch.Tensor.to and _names_device(args[1:], kwargs)):
            return _plain(out)
        return _mark(out) if marked else out


def _names_device(args, kwargs) -> bool:
    return "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args)


def _plain(out):
    return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out


def _mark(out):
    if isinstance(out, torch.Tensor) and not isinstance(out, OnDevice):
        return out.as_subclass(OnDevice)
    if isinstance(out, (tuple, list)):
        return type(out)(_mark(o) for o in out)
    return out


def to_device(t):
    """``t`` marked as on the device."""
    return t.as_subclass(OnDevice) if isinstance(t, torch.Tensor) else t


def to_host(t):
    """``t`` unmarked (a result handed back to code outside the test's scope)."""
    return _plain(t)
