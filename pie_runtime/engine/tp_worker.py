"""Tensor parallelism inside one engine (``pie engine --tensor-parallel T``): rank 0 is the engine process —
scheduler, socket, page tables, sampling and epilogues — and T-1 worker processes (spawned, one per other
rank) hold the other shards (``models/tensor_parallel.py``).

Every step, rank 0 announces what it is about to run with ``broadcast_object_list`` — a forward's segments
(page tables), token ids and positions; a page copy; an lm-head call, followed by its hidden states — and
every rank then runs the same computation on its shard, meeting in the same collectives. torch.distributed
with gloo on CPU (each rank ``threads`` threads), NCCL on CUDA (rank r on ``cuda:r``). Float32 weights only.

Failure: once rank 0 has announced a step, every rank must finish it, meeting in its collectives. When rank
0 fails inside a step instead (an exception in its share), the others wait in a collective it will never
join, so rank 0 ends the group (``TPGroup.fail``): it destroys its process group, which fails the workers'
pending collective at once ("connection closed by peer"), and a worker whose collective fails exits. The
group is then broken: every later step raises ``TensorParallelBroken`` and the engine stops
(``on_broken``), so its supervisor starts a new one. A worker also dies with its engine: the kernel's
``PR_SET_PDEATHSIG``, and a thread that watches its parent. A worker that fails fails rank 0's next
collective the same way.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..models.context import Segment
from ..models.kv_cache import KVCache
from ..models.llama import LlamaForCausalLM
from ..models.tensor_parallel import VocabParallelHead, check_shardable, local_config, shard
from ..store import load_model
from .runner import ModelRunner

log = logging.getLogger("pie.engine")

_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step as long as the engine idles


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorParallelBroken(RuntimeError):
    """The ranks are out of step (rank 0 failed inside a step the others had joined): no step can run again."""


class TPRunner(ModelRunner):
    """Rank 0's runner: announces each forward and page copy to the workers before running its shard."""

    kv_transfer = False  # each rank holds its heads' K/V: ws_read_kv and ws_append_kv are refused

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device: torch.device, group: TPGroup) -> None:
        super().__init__(model, kv, device)
        self.group = group

    @property
    def attention_scores(self) -> bool:
        return False  # each rank holds some heads: fire admission refuses the attention readout

    def forward(self, segments: list[Segment], tokens: list[int], positions: list[int], scores=None) -> torch.Tensor:
        assert scores is None, "fire admission refuses the attention readout on a tensor-parallel engine"
        with self.group.step(("forward", segments, tokens, positions)):
            return super().forward(segments, tokens, positions)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        with self.group.step(("copy", src, dst)):
            super().copy_pages(src, dst)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Row moves (a tree fold's path, an eviction's compaction) on every rank's shard of the pool."""
        with self.group.step(("copy_slots", src, dst)):
            super().copy_slots(src, dst)


class AnnouncedHead(torch.nn.Module):
    """Rank 0's lm head: announces the call and sends its hidden states before scoring its vocabulary slice."""

    def __init__(self, head: VocabParallelHead, group: TPGroup) -> None:
        super().__init__()
        self.head = head
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        with self.group.step(("logits", int(hidden.shape[0]))):
            dist.broadcast(hidden.contiguous(), src=0)
            return self.head(hidden)


class TPGroup:
    """Rank 0's side of the process group: the workers it spawned and the steps it announces to them."""

    def __init__(self, world: int, device: str, procs: list[Any]) -> None:
        self.world = world
        self.device = device
        self.procs = procs
        self.broken: str | None = None  # why the group ended, once it has
        self.on_broken: Callable[[str], None] | None = None  # the engine's stop
        self._stopped = False
        atexit.register(self.stop)

    @contextlib.contextmanager
    def step(self, command: tuple) -> Iterator[None]:
        """Announces ``command``; the with-block is rank 0's share of it. A failure from the announcement on
        leaves the workers waiting in a collective that rank 0 will not join: the group is ended (``fail``)."""
        if self.broken is not None:
            raise TensorParallelBroken(self.broken)
        try:
            dist.broadcast_object_list([command], src=0)
            yield
        except Exception as e:
            self.fail(f"rank 0 failed in a {command[0]} step: {type(e).__name__}: {e}")
            raise TensorParallelBroken(self.broken) from e

    def fail(self, why: str) -> None:
        """Ends the group: the workers' pending collective fails and they exit (killed after 5 s if not)."""
        if self.broken is not None:
            return
        self.broken = why
        log.error("tensor parallelism: %s; the ranks are out of step, the group ends", why)
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        self._reap(5.0)
        if self.on_broken is not None:
            self.on_broken(why)

    def _reap(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.broken is not None:
            self._reap(0.0)
            return
        try:
            dist.broadcast_object_list([("stop",)], src=0)
        finally:
            self._reap(10.0)
            dist.destroy_process_group()


def start_tensor_parallel(
    name: str,
    model: LlamaForCausalLM,
    world: int,
    kv_pages: int,
    page_size: int,
    device: str,
    threads: int,
    swa_full: bool = False,
) -> tuple[TPRunner, KVCache]:
    """Spawns ranks 1..world-1, shards ``model`` as rank 0, and returns rank 0's runner and KV cache. Every rank
    keeps the same page groups (``swa_full``: models/kv_groups.py) over its heads."""
    check_shardable(model.config, world)
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker_main,
            args=(rank, world, init, name, device, kv_pages, page_size, threads, os.getpid(), swa_full),
            daemon=True,
        )
        for rank in range(1, world)
    ]
    for p in procs:
        p.start()
    torch.set_num_threads(threads)
    dist.init_process_group(_backend(device), init_method=init, rank=0, world_size=world, timeout=_TIMEOUT)
    group = TPGroup(world, device, procs)
    shard(model, 0, world)
    head = model.lm_head
    assert isinstance(head, VocabParallelHead)
    setattr(model, "lm_head", AnnouncedHead(head, group))  # noqa: B010 - a module swap, as ``shard``'s
    dev = _rank_device(device, 0)
    layout = KVCache.layout_of(model.config, 0, swa_full)
    kv = KVCache(local_config(model.config, 0, world), kv_pages, page_size, torch.float32, str(dev), layout=layout)
    dist.barrier()  # every worker has its shard and its cache
    return TPRunner(model, kv, dev, group), kv


def worker_main(
    rank: int,
    world: int,
    init: str,
    name: str,
    device: str,
    kv_pages: int,
    page_size: int,
    threads: int,
    parent: int,
    swa_full: bool = False,
) -> None:
    """Rank ``rank``: build its shard, then run what rank 0 announces until it says stop. Exits when a
    collective fails (rank 0 ended the group, or died) or its parent is gone."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    torch.set_num_threads(threads)
    dev = _rank_device(device, rank)
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=world, timeout=_TIMEOUT)
    model = load_model(name, dtype=torch.float32, device=dev, keep_quantized=False).model
    assert isinstance(model, LlamaForCausalLM)  # build.py refuses tensor parallelism for the other families
    shard(model, rank, world)
    layout = KVCache.layout_of(model.config, 0, swa_full)
    kv = KVCache(local_config(model.config, rank, world), kv_pages, page_size, torch.float32, str(dev), layout=layout)
    runner = ModelRunner(model, kv, dev)
    try:
        dist.barrier()
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            op, *rest = box[0]
            if op == "forward":
                runner.forward(*rest)
            elif op == "copy":
                kv.copy_pages(*rest)
            elif op == "copy_slots":
                kv.copy_slots(*rest)
            elif op == "logits":
                hidden = torch.empty(rest[0], model.config.hidden_size, dtype=torch.float32, device=dev)
                dist.broadcast(hidden, src=0)
                with torch.inference_mode():
                    model.logits(hidden)
            else:
                break
    except Exception as e:  # noqa: BLE001 - a collective failed: rank 0 ended the group or died; or ours failed
        print(f"pie tensor-parallel rank {rank}: leaving the group: {type(e).__name__}: {e}", file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)  # not a normal exit: tearing down a broken group can block
    dist.destroy_process_group()


def _exit_with_parent(parent: int) -> None:
    """Backs up the parent-death signal (which follows the thread that started us, not the process)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)
