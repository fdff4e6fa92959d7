"""The event loop's wake-up (ps/membership/event_loop.py): a post from another thread is always seen,
however posts and the loop's drain interleave; a lost wake-up would strand work forever."""
import os
import queue
import threading
import time

from bps_gc.ps.membership import event_loop
from bps_gc.ps.membership.event_loop import EventLoop


def make_loop(total):
    posts, seen = queue.SimpleQueue(), []
    loop = EventLoop(interval=5.0)  # a long idle poll: only wake-ups move the work

    def handle():
        while True:
            try:
                seen.append(posts.get_nowait())
            except queue.Empty:
                return True if len(seen) == total else None

    loop.wakeable(handle)
    return loop, posts, seen


def test_a_post_whose_byte_the_drain_takes_does_not_silence_later_posts(monkeypatch):
    """The schedule that once hung the benchmark: another thread posts (and writes its wake-up
    byte) just as the loop drains the pipe, so the drain's read takes that byte. Later posts
    must still wake the loop."""
    loop, posts, seen = make_loop(total=3)
    real_read = os.read
    injected = []

    def read_after_a_post(fd, n):
        if not injected:  # the first drain: a post lands right before its read
            injected.append(True)
            t = threading.Thread(target=lambda: (posts.put("during the drain"), loop.wake()))
            t.start()
            t.join()
        return real_read(fd, n)

    monkeypatch.setattr(event_loop.os, "read", read_after_a_post)
    done = []
    runner = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    runner.start()
    posts.put("first")
    loop.wake()
    deadline = time.monotonic() + 10
    while len(seen) < 2 and time.monotonic() < deadline:  # the drain that took both bytes
        time.sleep(0.01)
    assert seen == ["first", "during the drain"]
    posts.put("after")  # a later post
    loop.wake()
    runner.join(timeout=10)
    assert not runner.is_alive(), "the post after the drain never woke the loop"
    assert seen == ["first", "during the drain", "after"] and done == [True]
    loop.close()


def test_no_post_is_stranded_under_a_storm_of_wake_ups():
    total = 20000
    loop, posts, seen = make_loop(total)
    done = []
    runner = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    runner.start()
    for i in range(total):
        posts.put(i)
        loop.wake()
    runner.join(timeout=20)
    assert not runner.is_alive(), f"the loop saw {len(seen)} of {total} posts, then no wake-up came"
    assert seen == list(range(total)) and done == [True]
    loop.close()


def test_a_wake_up_interrupted_by_ctrl_c_does_not_silence_later_posts(monkeypatch):
    """Ctrl-C reaches the posting (main) thread inside wake(), before its byte is written: the
    post after it (a worker's goodbye, at exit) must still wake the loop. Once, a flag left set
    with no byte in the pipe stranded that goodbye, and the interrupted worker never left."""
    loop, posts, seen = make_loop(total=1)
    real_write = os.write

    def interrupted_write(fd, data):
        monkeypatch.setattr(event_loop.os, "write", real_write)  # only the first write
        raise KeyboardInterrupt

    monkeypatch.setattr(event_loop.os, "write", interrupted_write)
    try:
        loop.wake()
        raise AssertionError("the interrupt did not reach the caller")
    except KeyboardInterrupt:
        pass
    done = []
    runner = threading.Thread(target=lambda: done.append(loop.run()), daemon=True)
    runner.start()
    posts.put("goodbye")
    loop.wake()
    runner.join(timeout=10)
    assert not runner.is_alive(), "the post after the interrupted wake-up never woke the loop"
    assert seen == ["goodbye"] and done == [True]
    loop.close()
