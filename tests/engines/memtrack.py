"""Count the bytes of tensor storage that are alive, as allocated by any op run under the mode.

Independent of the code it measures: a TorchDispatchMode sees every aten op (factories, gathers'
buffers, copies), and a finaliser on each new storage (PyTorch keeps one Python object per live
storage) subtracts it when it is freed. ``peak`` is the most bytes alive at once, ``largest`` the
biggest single allocation. Storages that existed before the block are not counted.
"""
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.largest = 0
        self._seen: set = set()
        self._lock = threading.Lock()

    def _freed(self, key, nbytes):
        with self._lock:
            self._seen.discard(key)
            self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)
                 and t.device.type != "meta"}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in known or key in self._seen:
                continue
            nbytes = storage.nbytes()
            with self._lock:
                self._seen.add(key)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, nbytes)
            weakref.finalize(storage, self._freed, key, nbytes)
        return out
