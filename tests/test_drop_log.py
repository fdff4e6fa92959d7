"""Bad messages are logged rate-limited by one helper (bps_gc.wire.sockets.DropLog) that
every role uses: the first few in full, then one line per interval with the running count."""
import logging

from bps_gc.wire.sockets import DropLog


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_flood_of_bad_messages_costs_a_few_log_lines():
    logger = logging.getLogger("test_drop_log")
    logger.propagate = False
    lines = Lines()
    logger.addHandler(lines)
    dropped = DropLog(logger, first=5, every=3600.0)
    for i in range(10_000):
        dropped("a malformed message: %s", f"frame {i}")
    assert dropped.count == 10_000
    assert lines.lines == [f"dropped a malformed message: frame {i} ({i + 1} so far)" for i in range(5)]
    dropped.next_at = 0.0  # the interval has passed: one more line, with the count
    dropped("a malformed message: %s", "late")
    assert lines.lines[-1] == "dropped a malformed message: late (10001 so far)" and len(lines.lines) == 6
