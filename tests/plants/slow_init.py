"""Imported by a rank (a suite's `imports`): rank 0's init_process_group returns only SLOW_S after it connected,
as a rank descheduled on a loaded machine does; the time it returned is in SLOW_INIT_DONE."""

from __future__ import annotations

import os
import time

import torch.distributed as dist

SLOW_S = 2.0
_connect = dist.init_process_group


def _slow_init(*args, **kwargs):
    _connect(*args, **kwargs)
    if os.environ.get("RANK") == "0":
        time.sleep(SLOW_S)
    os.environ["SLOW_INIT_DONE"] = repr(time.time())


dist.init_process_group = _slow_init
