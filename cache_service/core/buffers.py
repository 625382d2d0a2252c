"""A growable int32 array: amortised O(n) appends, O(1) truncation, views without copies."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt


class IntBuffer:
    __slots__ = ("_data", "_len")

    def __init__(self, capacity: int = 16) -> None:
        self._data = np.empty(max(capacity, 1), dtype=np.int32)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def view(self) -> npt.NDArray[np.int32]:
        """The live contents (a view: valid until the next extend)."""
        return self._data[: self._len]

    def extend(self, values: npt.NDArray[np.int32]) -> None:
        n = values.size
        end = self._len + n
        if end > self._data.size:
            grown = np.empty(max(end, 2 * self._data.size), dtype=np.int32)
            grown[: self._len] = self._data[: self._len]
            self._data = grown
        self._data[self._len : end] = values
        self._len = end

    def truncate(self, n: int) -> None:
        if not 0 <= n <= self._len:
            raise ValueError(f"truncate to {n} outside [0, {self._len}]")
        self._len = n

    def clear(self) -> None:
        self._len = 0

    @property
    def nbytes(self) -> int:
        return int(self._data.nbytes)
