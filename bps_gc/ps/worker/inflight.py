"""What the worker I/O thread's parts share (io.py): the pushes sent and awaiting their replies.
All of it is touched on the I/O thread only."""
import dataclasses


@dataclasses.dataclass
class InFlight:
    # key -> the Push (push.py) sent and awaiting its reply: added by PushSending.sent, removed
    # by Replies (the reply, or the server's error for it) and ``fail_all``
    inflight: dict = dataclasses.field(default_factory=dict)
    # their payload bytes, which PushSending keeps under its window: added by PushSending.sent,
    # subtracted by Replies as each is answered
    inflight_bytes: int = 0
    # key -> the server's error for its declaration: written by Replies (an ERROR reply), read
    # by PushSending.refused, which fails every later push of that key with it
    failed_keys: dict = dataclasses.field(default_factory=dict)

    def fail_all(self, error):
        """Fail every push awaiting its reply (the I/O thread failed: none will come)."""
        for push in self.inflight.values():
            push.handle.fail(error)
        self.inflight.clear()
