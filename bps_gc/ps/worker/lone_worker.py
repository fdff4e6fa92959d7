"""A worker that trains alone, as BytePS does: one worker process and BYTEPS_FORCE_DISTRIBUTED
unset, so nothing leaves the process. It says so, and where the environment shows that a job
of roles was meant (DMLC_ROLE=worker, servers declared) it tells the scheduler, which ends the
job for itself and the servers (exit 0, each saying why) instead of letting them wait out
BPS_GC_JOIN_TIMEOUT for a worker that will never come."""
import os
import sys
import threading

from ...wire.wire import Msg
from ..membership.membership import tell_scheduler

AT_EXIT = 3.0  # seconds shutdown() gives an unanswered notice (the scheduler may start late)


class LoneWorker:
    def __init__(self, cfg, environ=None):
        env = os.environ if environ is None else environ
        self.reason = (f"one worker process: DMLC_NUM_WORKER={cfg.num_worker}, "
                       f"BYTEPS_LOCAL_SIZE={cfg.local_size}, BYTEPS_FORCE_DISTRIBUTED unset")
        print(f"bps_gc: {self.reason}: this worker trains alone and nothing leaves the process; "
              f"BYTEPS_FORCE_DISTRIBUTED=1 sends through the servers", file=sys.stderr, flush=True)
        self.stop, self.thread = threading.Event(), None
        if env.get("DMLC_ROLE") == "worker" and cfg.num_server > 0:
            where = f"{cfg.root_uri}:{cfg.root_port}"
            self.thread = threading.Thread(target=self.tell, args=(cfg, where), daemon=True,
                                           name="bps_gc-lone-worker")
            self.thread.start()

    def tell(self, cfg, where):
        if tell_scheduler(cfg, "worker", cfg.rank, cfg.join_timeout, self.stop, alone=self.reason) == Msg.SHUTDOWN:
            print(f"bps_gc: told the scheduler at {where} and its servers to exit (this job needs "
                  f"neither)", file=sys.stderr, flush=True)

    def close(self):
        if self.thread is not None:
            self.thread.join(AT_EXIT)
            self.stop.set()
            self.thread.join()
