"""The end of a spawned rank's work in the multi-process tests (gloo on CPUs, NCCL on GPUs)."""

import contextlib
import os

import torch.distributed as dist


@contextlib.contextmanager
def rank_body():
    """Wrap a rank's work after ``init_process_group``: on leaving, a barrier (no rank leaves while
    another still runs a collective) and ``destroy_process_group``; an exception propagates to
    ``torch.multiprocessing.spawn`` as usual, and a rank that finished cleanly then ends its
    process at once (``os._exit(0)``): the interpreter's own shutdown aborted in about 1 run of 8
    (torch 2.13, gloo: "terminate called without an active exception", SIGABRT after the test
    body had passed)."""
    try:
        yield
    finally:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(0)
