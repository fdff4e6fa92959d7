"""A worker's shared memory with the servers on its host (wire/shm.py; BPS_GC_SHM).

Each dense key for a server reached over its unix socket gets, at INIT, a slot in this worker's
arena, offered in the declaration; once the server's INIT_ACK names the key's two alternating
result buffers, a push of the key is one copy into the slot (on the pushing thread when the
push is made) and a bare header, and its reply is a view of the round's result buffer that the
codec pool copies out. Keys the server did not take stay on the socket.
"""
import logging

import numpy as np

from ...wire import shm
from ...wire.wire import MalformedMessage, decode_json

log = logging.getLogger("bps_gc.worker")


class SharedSlots:
    def __init__(self, cfg, local):
        """``local[s]``: whether server ``s`` is on this host (its unix socket is used)."""
        self.local = local
        # async servers answer with snapshots, not the two alternating result buffers
        self.arena = shm.Arena() if cfg.shm and not cfg.enable_async and shm.supported() else None
        self.peer_maps = shm.PeerMaps()
        self.slots = {}  # key -> this worker's slot (writable uint8 view)
        self.results = {}  # key -> the server's two result buffers (read-only uint8 view)

    def offer(self, key, server, dtype, decl):
        """The INIT declaration, with a slot offered if the key and server allow it."""
        if self.arena is None or not self.local[server] or decl.get("params") or decl["n"] <= 0:
            return decl
        try:
            offer, self.slots[key] = self.arena.allocate(decl["n"] * np.dtype(dtype).itemsize)
        except OSError as e:
            log.warning("no shared memory for key %d (the socket carries it): %s", key, e)
            return decl
        return {**decl, "shm": offer}

    def accept(self, key, payload):
        """An INIT_ACK with a payload: the server took the slot; map its result buffers."""
        if key not in self.slots:
            return
        try:
            offer = decode_json(payload).get("shm")
            self.results[key] = self.peer_maps.view(offer, 2 * self.slots[key].nbytes)
        except (shm.ShmUnavailable, MalformedMessage) as e:
            log.info("key %d stays on the socket: %s", key, e)

    def prefill(self, push):
        """Copy a push into its key's slot, if the server took it (usually on the pushing
        thread, off the I/O thread). The slot is free: a tensor has one push_pull running at a
        time, and the server read the slot before its last reply."""
        if not push.compressed and push.part.key in self.results:
            np.copyto(self.slots[push.part.key].view(push.dtype), push.payload)
            push.shared = True

    def take(self, push):
        """Whether a push goes through its key's slot (copied there now if the INIT_ACK came
        after the push was made)."""
        if not push.shared:
            self.prefill(push)
        return push.shared

    def result(self, push):
        """The push's round's result in the server's buffer. The server keeps it until this
        worker's next push of the key, which waits for the copy out."""
        nbytes = push.dest.nbytes
        start = (push.round % 2) * nbytes
        return self.results[push.part.key][start:start + nbytes]

    def close(self):
        if self.arena is not None:
            self.arena.close()


__all__ = ["SharedSlots"]
