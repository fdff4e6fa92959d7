"""Point-to-point messages between K in-process gossip nodes (one thread each; sends never
block): the ``comm`` of bps_gc.algorithms.gossip, for tests that run every node in one process."""
import collections
import queue
import threading

import numpy as np


class Mailbox:
    def __init__(self):
        self.queues = collections.defaultdict(queue.Queue)
        self.lock = threading.Lock()
        self.sent = 0  # bytes
        self.log = collections.defaultdict(list)  # sender rank -> its messages, in order

    def node(self, rank, size):
        box = self

        class Comm:
            def rank(self):
                return rank

            def size(self):
                return size

            def send(self, to, name, payload):
                data = np.array(payload, np.uint8).copy()
                with box.lock:
                    box.queues[(rank, to, name)].put(data)
                    box.sent += data.nbytes
                    box.log[rank].append(data.tobytes())

            def recv(self, frm, name, timeout=None):
                with box.lock:
                    mine = box.queues[(frm, rank, name)]
                return mine.get(timeout=30)
        return Comm()


def in_threads(calls):
    """Run each call (a no-argument callable) in its own thread, as the nodes of one round
    (D-PSGD waits for its neighbours); raise the first error in the caller's thread."""
    errors = []

    def guarded(call):
        try:
            call()
        except BaseException as e:  # re-raised below
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(c,)) for c in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
