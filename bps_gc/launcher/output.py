"""The launcher's own messages, and copying children's output line by line under a label."""
import sys
import threading

# One lock per destination, shared by reader threads and say(), so lines never interleave.
_locks = {}
_locks_guard = threading.Lock()
READ_LIMIT = 65536  # longest piece read at once; a longer line continues without a new label


def lock_for(stream):
    with _locks_guard:
        return _locks.setdefault(id(stream), threading.Lock())


def say(message):
    """`bpslaunch: <message>` on stderr."""
    stream = _binary(sys.stderr)
    _write(stream, f"bpslaunch: {message}\n".encode(errors="replace"), lock_for(stream))


def copy_labelled(source, destination, label, lock=None):
    """Copy binary `source` to binary `destination` until EOF, each line prefixed `[label] `.

    A last line without a newline gets one. If the destination breaks (reader of our stdout
    gone), keep draining the source so the child never blocks on a full pipe.
    """
    prefix = f"[{label}] ".encode()
    lock = lock or lock_for(destination)
    at_line_start = True
    for piece in iter(lambda: source.readline(READ_LIMIT), b""):
        data = (prefix if at_line_start else b"") + piece
        at_line_start = piece.endswith(b"\n")
        destination = _write(destination, data, lock)
    if not at_line_start:
        _write(destination, b"\n", lock)


def start_labelled_readers(proc, label):
    """Threads copying proc's stdout and stderr pipes to ours; join them after proc exits."""
    threads = []
    for source, target in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
        if source is None:
            continue
        destination = _binary(target)
        thread = threading.Thread(target=copy_labelled, args=(source, destination, label),
                                  name=f"output-{label}", daemon=True)
        thread.start()
        threads.append(thread)
    return threads


def _write(destination, data, lock):
    if destination is None:
        return None
    try:
        with lock:
            destination.write(data)
            destination.flush()
        return destination
    except (OSError, ValueError):  # broken pipe, closed stream
        return None


def _binary(stream):
    return getattr(stream, "buffer", stream)
