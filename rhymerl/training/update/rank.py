"""One trainer rank: :class:`TrainerRank`, what runs in each rank's process (how it holds the
model is :mod:`rhymerl.model.data_parallel`; the batch's split is
:mod:`rhymerl.training.update.token_balance`).

The controller's side (starting the ranks, calling them, failing fast) is
``rhymerl.training.update.trainer_group``. A rank never calls back into the controller.
"""
from __future__ import annotations

import logging
import os
import resource
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from rhymerl.model.data_parallel import get_strategy

if TYPE_CHECKING:  # config types only
    from rhymerl.config import AlgorithmSection, TrainerSection

log = logging.getLogger(__name__)


# --- one rank --------------------------------------------------------------------------------------
@dataclass
class RankSpec:
    """How to build one trainer rank (sent once, at start)."""

    model_path: str
    trainer: TrainerSection
    algorithm: AlgorithmSection
    rank: int
    world_size: int
    device: str = "cpu"  # cpu, or cuda (rank r takes cuda:r modulo the visible devices)
    with_ref: bool = False
    total_optimizer_steps: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    threads: int = 1
    # local backend, rank 0: where it publishes new weights (the controller's model lives there)
    publish_to: tuple[torch.Tensor, list[tuple[str, int, tuple[int, ...]]]] | None = None


def param_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of parameters, gradients and optimizer state this rank holds (its shards only)."""
    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in model.parameters():
        total += local(p).numel() * p.element_size()
        if p.grad is not None:
            total += local(p.grad).numel() * p.grad.element_size()
    for st in optimizer.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor):
                total += local(v).numel() * v.element_size()
    return total


class TrainerRank:
    """One rank: joins the process group, holds its part of the policy, runs its part of each update."""

    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        torch.set_num_threads(max(1, spec.threads))
        self.trainer: Any = None

    def ping(self) -> int:
        return os.getpid()

    def node_address(self) -> str:
        """Rank 0 (a cluster): the rendezvous address, a socket bound to this node's cluster
        address alone (not every interface) and held open until the store takes it over in
        :meth:`setup` (no window in which another process can take the port)."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()
        self._listen = socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET)
        self._listen.bind((ip, 0))
        self._listen.listen()
        return f"tcp://{ip}:{self._listen.getsockname()[1]}"

    def setup(self, init_method: str, loopback_only: bool) -> int:
        """Join the group, load and wrap the policy (and reference), build the optimizer."""
        import torch.distributed as dist

        from rhymerl.model import load_pretrained
        from rhymerl.training.update.trainer import PolicyTrainer

        spec, tcfg = self.spec, self.spec.trainer
        if loopback_only:
            os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # gloo's pairs listen on 127.0.0.1 only
        cuda = spec.device.startswith("cuda") and torch.cuda.is_available()
        device = torch.device(f"cuda:{spec.rank % torch.cuda.device_count()}") if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        timeout = timedelta(seconds=tcfg.collective_timeout_s)
        if init_method.startswith("tcp://"):  # a cluster: rank 0's store listens on the socket node_address bound
            host, port = init_method[len("tcp://"):].rsplit(":", 1)
            listen = getattr(self, "_listen", None) if spec.rank == 0 else None
            store = dist.TCPStore(host.strip("[]"), int(port), spec.world_size, spec.rank == 0, timeout,
                                  master_listen_fd=listen.fileno() if listen is not None else None)
            dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timeout)
        else:
            dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=spec.rank,
                                    world_size=spec.world_size, timeout=timeout)
        strategy = get_strategy(tcfg.strategy)
        model = load_pretrained(spec.model_path, device=device, dtype=torch.float32)
        ref = None
        if spec.with_ref:
            ref = load_pretrained(spec.model_path, device=device, dtype=torch.float32).eval().requires_grad_(False)
            ref = strategy.wrap(ref, trainable=False)
        wrapped = strategy.wrap(model, trainable=True)
        self.trainer = PolicyTrainer(wrapped, tcfg, spec.algorithm, device, ref,
                                     total_optimizer_steps=spec.total_optimizer_steps, temperature=spec.temperature,
                                     top_p=spec.top_p, top_k=spec.top_k, rank=spec.rank,
                                     world_size=spec.world_size, grad_sync=strategy.grad_sync(wrapped))
        return os.getpid()

    # --- the step ----------------------------------------------------------------------------------
    def compute_logps(self, exp: Any) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """This rank's rows' old and reference log-probs: (rows, old [n, W], ref [n, W])."""
        self.trainer.compute_logps(exp)
        rows = self.trainer.rank_parts(exp, torch.arange(exp.input_ids.shape[0]))[self.spec.rank]
        old = exp.old_logp[rows] if exp.old_logp is not None else None
        ref = exp.ref_logp[rows] if exp.ref_logp is not None else None
        return rows, old, ref

    def update(self, exp: Any, step: int, seed: int) -> tuple[dict[str, float], dict[str, float], float, int]:
        sums, counts, lr = self.trainer.update_sums(exp, step, seed)
        return sums, counts, lr, self.trainer.bad_steps

    def gradient(self, exp: Any) -> dict[str, Any] | None:
        """The whole batch's gradient as one mini-batch (no optimizer step); rank 0 gets it
        in full (numpy, by parameter name), the others None. For ``bench train``."""
        tr = self.trainer
        tr.optimizer.zero_grad(set_to_none=True)
        tr.model.train()
        tr.accumulate_gradient(exp, torch.arange(exp.input_ids.shape[0]))
        tr.model.eval()
        grads = {}
        for name, p in _named_parameters(tr.model):
            g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad  # a collective under FSDP
            grads[name] = g.detach().cpu().numpy()
        tr.optimizer.zero_grad(set_to_none=True)
        return grads if self.spec.rank == 0 else None

    def memory(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes, and its peak resident memory."""
        return {"param_state_bytes": param_state_bytes(self.trainer.model, self.trainer.optimizer),
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}

    # --- weights and checkpoints --------------------------------------------------------------------
    def publish(self) -> dict[str, Any] | int:
        """Gather the full policy once, on rank 0 (a collective), and hand it on: into the shared
        buffer (local backend; returns its byte count) or as numpy arrays (Ray's object store)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.trainer.model,
                                    options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.spec.rank != 0:
            return 0
        if self.spec.publish_to is not None:
            flat, layout = self.spec.publish_to
            with torch.no_grad():
                for name, off, shape in layout:
                    t = full[name]
                    flat[off:off + t.numel()].copy_(t.reshape(-1).to(torch.float32))
            return int(flat.numel() * flat.element_size())
        return {name: t.to(torch.float32).numpy() for name, t in full.items()}

    def save_state(self, folder: str) -> None:
        self.trainer.save_state(Path(folder))

    def load_state(self, folder: str, ranks: int) -> str | None:
        """None once loaded; a damaged checkpoint's message otherwise (the rank stays up, so the
        controller can fall back to an older checkpoint)."""
        from rhymerl.training.checkpoint import CheckpointError

        try:
            self.trainer.load_state(Path(folder), ranks)
        except CheckpointError as e:
            return str(e)
        return None

    def bad_steps(self) -> int:
        return self.trainer.bad_steps

    def set_bad_steps(self, n: int) -> None:
        self.trainer.bad_steps = n

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _named_parameters(model: nn.Module):
    inner = model.module if hasattr(model, "module") else model  # DDP's wrapper adds "module."
    return inner.named_parameters()
