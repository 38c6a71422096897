"""cuferry for Python: safetensors checkpoints loaded straight into CUDA memory, and DLPack.

A thin face over the Rust crate cuferry (a safe CUDA engine): files are read with positioned
reads on many threads into pinned staging and copied to the device while the next reads run.
torch is optional: it is imported only when a load hands its tensors to torch.

- ``load(path, device=0, select=None, progress=False)``: a safetensors file, or a sharded set
  through its ``*.safetensors.index.json``, as a dict of torch tensors (when torch is
  installed) or of :class:`Tensor` (when it is not, or with ``native=True``).
- ``save(path, tensors)``: a dict of CUDA tensors (torch's, cuferry's, any DLPack producer's)
  to a safetensors file.
- ``from_dlpack(obj, device=None)``: any DLPack producer's CUDA tensor as a :class:`Tensor`.

Errors: :class:`Error` (a ``RuntimeError``) for what the engine reports, its message naming the
file and the tensor, its ``kind`` attribute the engine's category (``"io"``, ``"malformed"``,
``"setup"``, ``"usage"``, ``"driver"``, ``"out_of_memory"``, ...); :class:`UsageError` (both an
``Error`` and a ``ValueError``) for what the engine refused as a wrong call; ``TypeError`` and ``ValueError``
for arguments this module checks itself; ``BufferError`` for the DLPack protocol's refusals.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable, Iterable, Union

from . import _native
from ._native import Error, Tensor, UsageError, __version__

__all__ = ["Error", "Tensor", "UsageError", "from_dlpack", "load", "save", "__version__"]

_NO_TORCH = object()
_torch_module = None


def _torch():
    """torch, when it is installed (imported on first need), else None."""
    global _torch_module
    if _torch_module is None:
        try:
            import torch
        except ImportError:
            torch = _NO_TORCH
        _torch_module = torch
    return None if _torch_module is _NO_TORCH else _torch_module


def _ordinal(device, what="device"):
    """A CUDA device ordinal from an int, "cuda", "cuda:N" or a torch.device."""
    if isinstance(device, bool):
        raise TypeError(f"{what} must be an int, 'cuda:N' or a torch.device, not a bool")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"{what} must be a CUDA device ordinal (0 or more), not {device}")
        return device
    if isinstance(device, str):
        kind, _, index = device.partition(":")
        if kind != "cuda" or (index and not index.isdigit()):
            raise ValueError(f"{what} must be 'cuda' or 'cuda:N', not {device!r}")
        return int(index) if index else _current_cuda_device()
    kind, index = getattr(device, "type", None), getattr(device, "index", None)
    if kind is not None:  # a torch.device
        if kind != "cuda":
            raise ValueError(f"{what} must be a CUDA device, not {device!r}")
        return _current_cuda_device() if index is None else int(index)
    raise TypeError(
        f"{what} must be an int, 'cuda:N' or a torch.device, not {type(device).__name__}"
    )


def _current_cuda_device():
    """torch's current CUDA device where torch is loaded, else 0."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        return torch.cuda.current_device()
    return 0


def _select(select):
    """The native form of ``select``: None, a frozenset of names, or a callable."""
    if select is None or callable(select):
        return select
    if isinstance(select, (str, bytes)):
        raise TypeError(
            "select must be None, an iterable of tensor names or a callable name -> bool, "
            "not a single string (wrap one name in a list)"
        )
    try:
        names = frozenset(select)
    except TypeError:
        raise TypeError(
            "select must be None, an iterable of tensor names or a callable name -> bool, "
            f"not {type(select).__name__}"
        ) from None
    for name in names:
        if not isinstance(name, str):
            raise TypeError(f"select: tensor names are str, not {type(name).__name__}")
    return names


def _size(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024


def _print_progress():
    """A progress callback that keeps one line on stderr up to date."""
    shown = [-1]

    def report(done, total):
        percent = 100 if total == 0 else done * 100 // total
        if percent == shown[0]:
            return
        shown[0] = percent
        end = "\n" if done >= total else ""
        sys.stderr.write(f"\rcuferry: loaded {_size(done)} of {_size(total)} ({percent}%){end}")
        sys.stderr.flush()

    return report


def _progress(progress):
    """The native form of ``progress``: None or a callable (bytes_done, bytes_total)."""
    if progress is None or progress is False:
        return None
    if progress is True:
        return _print_progress()
    if callable(progress):
        return progress
    raise TypeError(
        "progress must be False, True or a callable (bytes_done, bytes_total), "
        f"not {type(progress).__name__}"
    )


Device = Union[int, str, Any]  # an ordinal, "cuda", "cuda:N" or a torch.device


def load(
    path: str | os.PathLike[str],
    device: Device = 0,
    select: Iterable[str] | Callable[[str], bool] | None = None,
    progress: bool | Callable[[int, int], Any] = False,
    *,
    native: bool = False,
) -> dict[str, Any]:
    """Loads a safetensors checkpoint onto a CUDA device.

    ``path``: a ``.safetensors`` file, or the ``*.safetensors.index.json`` of a sharded set.
    ``device``: an ordinal, ``"cuda:N"`` or a ``torch.device``. ``select``: None (every
    tensor), an iterable of names, or a callable ``name -> bool``: the others are neither
    allocated nor read. ``progress``: False, True (one line on stderr), or a callable
    ``(bytes_done, bytes_total)``. The callables run while the load holds the device's engine,
    so they must not call cuferry (that raises :class:`UsageError`); an exception raised in one
    is raised once the load has stopped.

    Returns a dict by name, in file order: torch tensors when torch is installed (each handed
    over through DLPack, ordered on torch's current stream, no copy), :class:`Tensor` objects
    when it is not or when ``native=True``.

    Raises :class:`Error` naming the file (and the tensor) for a file that is missing, cannot
    be read or is malformed, and for a device that cannot be opened.
    """
    tensors = _native.load(
        os.fspath(path), _ordinal(device), _select(select), _progress(progress)
    )
    torch = None if native else _torch()
    if torch is None:
        return tensors
    return {name: torch.from_dlpack(tensor) for name, tensor in tensors.items()}


def save(path: str | os.PathLike[str], tensors: dict[str, Any]) -> None:
    """Saves a dict of CUDA tensors, all on one device, to a safetensors file.

    Each tensor is a :class:`Tensor` (still usable after) or any DLPack producer's CUDA tensor,
    torch's included, read without a copy (a strided one is saved as its row-major contents).
    The producer is asked to order its pending writes before the save reads. The file is
    written under a temporary name and renamed over ``path`` once complete, byte for byte what
    ``safetensors`` writes for the same tensors.

    Raises ``TypeError`` for a key that is not a str or a value that is not a DLPack tensor,
    ``ValueError`` for a tensor not on a CUDA device or tensors on several devices, and
    :class:`Error` for what the engine refuses (``__metadata__`` as a name, a file that cannot
    be written).
    """
    try:
        items = list(tensors.items())
    except AttributeError:
        raise TypeError(
            f"tensors must be a dict of name -> tensor, not {type(tensors).__name__}"
        ) from None
    for name, _ in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names are str, not {type(name).__name__}: {name!r}")
    _native.save(os.fspath(path), items)


def from_dlpack(obj: Any, device: Device | None = None) -> Tensor:
    """Any DLPack producer's CUDA tensor (torch's, cuferry's, CuPy's, JAX's) as a :class:`Tensor`.

    ``device``: None (the producer's device), or the same device as an ordinal, ``"cuda:N"``
    or a ``torch.device``; the import never copies between devices. The producer is asked to
    order its pending writes before the engine's work. A compact tensor comes in as a view of
    the producer's memory (kept alive by the :class:`Tensor`); a strided one as a compact copy.
    """
    return _native.from_dlpack(obj, None if device is None else _ordinal(device))
