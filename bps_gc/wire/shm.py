"""Shared memory between two processes on one host (BytePS's IPC mode).

A worker and a server on the same host pass dense partitions through memory both map instead
of through a socket: a push is one memcpy into the worker's slot, which the server sums from
in place, and a pull is one memcpy out of the server's result, instead of two kernel copies
and a socket wake-up each way.

The memory is an anonymous memfd, so the kernel frees it when the last process holding it
exits: a crash leaves nothing behind in /dev/shm. A peer reaches it through
``/proc/<pid>/fd/<fd>`` and maps it read-only (no process ever writes another's memory). The
owner seals it against shrinking, so a peer's mapping can never fault, and each chunk starts
with a random nonce the peer checks, so a stale or wrong pid/fd is refused. Any refusal is a
ShmUnavailable, and the pair keeps using the socket.
"""
import fcntl
import mmap
import os
import secrets

import numpy as np

CHUNK_BYTES = 64 << 20  # one memfd holds many partitions; pages are only allocated when written
ALIGN = 64
NONCE_BYTES = 16
SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)


def supported():
    return hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS") and os.path.isdir("/proc/self/fd")


class ShmUnavailable(Exception):
    """A peer's offer of shared memory cannot be used (the reason is the message)."""


class Arena:
    """Memory this process shares with its peers, handed out in aligned pieces."""

    def __init__(self, chunk_bytes=CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self.chunks = []  # [fd, mmap, nonce, bytes used]

    def allocate(self, nbytes):
        """(offer, view): ``view`` is writable uint8 memory of ``nbytes``; ``offer`` is the JSON
        a peer passes to ``PeerMaps.view`` to map the same bytes."""
        need = -(-nbytes // ALIGN) * ALIGN
        chunk = next((c for c in self.chunks if c[1].size() - c[3] >= need), None)
        if chunk is None:
            chunk = self._new_chunk(max(self.chunk_bytes, need + ALIGN))
        fd, memory, nonce, used = chunk
        chunk[3] = used + need
        view = np.frombuffer(memory, np.uint8, nbytes, used)
        offer = {"pid": os.getpid(), "fd": fd, "offset": used, "bytes": nbytes, "nonce": nonce.hex()}
        return offer, view

    def _new_chunk(self, size):
        size = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
        fd = os.memfd_create("bps_gc", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
            memory = mmap.mmap(fd, size)
        except OSError:
            os.close(fd)
            raise
        nonce = secrets.token_bytes(NONCE_BYTES)
        memory[:NONCE_BYTES] = nonce
        chunk = [fd, memory, nonce, ALIGN]  # the nonce's block is never handed out
        self.chunks.append(chunk)
        return chunk

    def close(self):
        """Close the descriptors; the memory lives on while views or peers' mappings do."""
        for chunk in self.chunks:
            os.close(chunk[0])
        self.chunks = []


class PeerMaps:
    """Other processes' offered memory, mapped read-only once per chunk."""

    def __init__(self):
        self.maps = {}  # (pid, fd) -> (mmap, nonce)

    def view(self, offer, nbytes):
        """A read-only uint8 view of the ``nbytes`` an offer names; ShmUnavailable if the offer is
        malformed, names other bytes, or cannot be reached from this process."""
        try:
            pid, fd, offset = (int(offer[k]) for k in ("pid", "fd", "offset"))
            nonce, size = bytes.fromhex(offer["nonce"]), offer["bytes"]
        except (KeyError, TypeError, ValueError) as e:
            raise ShmUnavailable(f"malformed offer: {e!r}") from None
        if size != nbytes or not isinstance(size, int):
            raise ShmUnavailable(f"offer of {size!r} bytes, expected {nbytes}")
        if pid <= 0 or fd < 0 or offset < NONCE_BYTES or offset % ALIGN or len(nonce) != NONCE_BYTES:
            raise ShmUnavailable("malformed offer: bad pid, fd, offset or nonce")
        memory = self._map(pid, fd, nonce)
        if offset + nbytes > memory.size():
            raise ShmUnavailable(f"offer of bytes {offset}..{offset + nbytes} past the end ({memory.size()})")
        return np.frombuffer(memory, np.uint8, nbytes, offset)

    def _map(self, pid, fd, nonce):
        cached = self.maps.get((pid, fd))
        if cached is not None and cached[1] == nonce:
            return cached[0]
        try:
            handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            raise ShmUnavailable(f"cannot open process {pid}'s memory: {e.strerror}") from None
        try:
            size = os.fstat(handle).st_size
            if size <= NONCE_BYTES:
                raise ShmUnavailable(f"process {pid}'s fd {fd} is not shared memory")
            if fcntl.fcntl(handle, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK == 0:
                raise ShmUnavailable(f"process {pid}'s memory is not sealed against shrinking")
            memory = mmap.mmap(handle, size, prot=mmap.PROT_READ)
        except OSError as e:
            raise ShmUnavailable(f"cannot map process {pid}'s memory: {e.strerror}") from None
        finally:
            os.close(handle)
        if memory[:NONCE_BYTES] != nonce:
            raise ShmUnavailable(f"process {pid}'s fd {fd} is not the memory offered (nonce differs)")
        self.maps[(pid, fd)] = (memory, nonce)
        return memory


__all__ = ["Arena", "PeerMaps", "ShmUnavailable", "supported"]
