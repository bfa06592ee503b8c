"""Tensor parallelism inside one engine (``pie engine --tensor-parallel T``): rank 0 is the engine process —
scheduler, socket, page tables, sampling and epilogues — and T-1 worker processes (spawned, one per other
rank) hold the other shards (``models/tensor_parallel.py``).

Every step, rank 0 announces what it is about to run with ``broadcast_object_list`` — a forward's segments
(page tables), token ids and positions; a page copy; an lm-head call, followed by its hidden states — and
every rank then runs the same computation on its shard, meeting in the same collectives. torch.distributed
with gloo on CPU (each rank ``threads`` threads), NCCL on CUDA (rank r on ``cuda:r``). Float32 weights only.
A worker dies with its engine (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import atexit
import ctypes
import datetime
import os
import signal
import socket
import sys
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

_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step as long as the engine idles


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def _rank_device(device: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TPRunner(ModelRunner):
    """Rank 0's runner: announces each forward and page copy to the workers before running its shard."""

    def __init__(self, model: LlamaForCausalLM, kv: KVCache, device: torch.device, group: TPGroup) -> None:
        super().__init__(model, kv, device)
        self.group = group

    def forward(self, segments: list[Segment], tokens: list[int], positions: list[int]) -> torch.Tensor:
        self.group.announce(("forward", segments, tokens, positions))
        return super().forward(segments, tokens, positions)

    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        self.group.announce(("copy", src, dst))
        super().copy_pages(src, dst)


class TPGroup:
    """Rank 0's side of the process group: the workers it spawned and the announcements it sends them."""

    def __init__(self, world: int, device: str, procs: list[Any]) -> None:
        self.world = world
        self.device = device
        self.procs = procs
        self._stopped = False
        atexit.register(self.stop)

    def announce(self, command: tuple) -> None:
        dist.broadcast_object_list([command], src=0)

    def announce_logits(self, hidden: torch.Tensor) -> None:
        self.announce(("logits", int(hidden.shape[0])))
        dist.broadcast(hidden.contiguous(), src=0)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        try:
            self.announce(("stop",))
        finally:
            for p in self.procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
            dist.destroy_process_group()


def start_tensor_parallel(
    name: str, model: LlamaForCausalLM, world: int, kv_pages: int, page_size: int, device: str, threads: int
) -> tuple[TPRunner, KVCache]:
    """Spawns ranks 1..world-1, shards ``model`` as rank 0, and returns rank 0's runner and KV cache."""
    check_shardable(model.config, world)
    init = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=worker_main,
            args=(rank, world, init, name, device, kv_pages, page_size, threads, os.getpid()),
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
    head.announce = group.announce_logits
    dev = _rank_device(device, 0)
    kv = KVCache(local_config(model.config, 0, world), kv_pages, page_size, torch.float32, str(dev))
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
) -> None:
    """Rank ``rank``: build its shard, then run what rank 0 announces until it says stop."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)
    torch.set_num_threads(threads)
    dev = _rank_device(device, rank)
    dist.init_process_group(_backend(device), init_method=init, rank=rank, world_size=world, timeout=_TIMEOUT)
    model = load_model(name, dtype=torch.float32, device=dev, keep_quantized=False).model
    assert isinstance(model, LlamaForCausalLM)  # build.py refuses tensor parallelism for the other families
    shard(model, rank, world)
    kv = KVCache(local_config(model.config, rank, world), kv_pages, page_size, torch.float32, str(dev))
    runner = ModelRunner(model, kv, dev)
    dist.barrier()
    while True:
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0)
        op, *rest = box[0]
        if op == "forward":
            runner.forward(*rest)
        elif op == "copy":
            kv.copy_pages(*rest)
        elif op == "logits":
            hidden = torch.empty(rest[0], model.config.hidden_size, dtype=torch.float32, device=dev)
            dist.broadcast(hidden, src=0)
            with torch.inference_mode():
                model.logits(hidden)
        else:
            break
    dist.destroy_process_group()
