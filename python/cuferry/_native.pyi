"""Type stubs of the compiled half of cuferry (`cuferry._native`)."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Tuple, Union

__version__: str

class Error(RuntimeError):
    """A failure the cuferry engine reported; ``kind`` names its category."""

    kind: str

class UsageError(Error, ValueError):
    """A call the cuferry engine refused because of what was passed."""

class Tensor:
    """A CUDA tensor of cuferry's, exported through DLPack by value, once."""

    @property
    def shape(self) -> Tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def device(self) -> int: ...
    @property
    def numel(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def exported(self) -> bool: ...
    def to_bytes(self) -> bytes: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...
    def __dlpack__(
        self,
        *,
        stream: Optional[int] = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...

def load(
    path: str,
    device: int = 0,
    select: Union[None, Iterable[str], Callable[[str], bool]] = None,
    progress: Optional[Callable[[int, int], Any]] = None,
) -> dict[str, Tensor]: ...
def save(path: str, tensors: list[tuple[str, Any]]) -> None: ...
def from_dlpack(obj: Any, device: Optional[int] = None) -> Tensor: ...
def _use_simulator() -> None: ...
