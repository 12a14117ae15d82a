"""Cohort training: the train messages in flight in the in-process engine, trained as one batched computation.

A round of a simulation hands ~10 small local runs to the clients; one after another, a GPU spends them
launching one client's small kernels after another (BENCHMARKS, "Cohort training"). When a pull needs a train
reply, the engine hands this module that message with every other train message in flight (each update is a
function of its message alone: its model version, the client's data and seed), and the clients that run the same
model train together: their trainable parameters are stacked into one (C, P) tensor, and every
local step is one ``torch.func.vmap`` over ``functional_call`` of the shared model — each client on its own batch
(its own seeded shuffle, :func:`common.training.epoch_batches`), with its own optimizer state. Clients with fewer
samples or steps are masked: padded rows carry no loss, and a client whose run is over keeps its parameters and
optimizer state (Adam's bias correction counts its own steps). The result is each client's update as
:func:`common.training.train` computes it, up to float rounding (a batched convolution sums in another order;
tests/test_cohort.py states the tolerance).

It serves the standard local recipe only: the default client side (:class:`strategies.client.ClientSide` itself,
as FedAvg, FedBuff, FedAsync, CA2FL, Feddle, FedMerge and the hybrid baselines use it) with the cross-entropy
objective, SGD or Adam, and a model whose training-mode forward is a function of its parameters and input alone
(no BatchNorm running statistics, no active dropout). A method with a client side or an objective of its own
(Ditto, FedDUAL, SCAFFOLD, FedProx, IFCA, FedEM, FedAvg+, the transfers), a slowed node (``latency-s``), a message
whose model or update travels encoded (``model-codec``, ``update-codec``: the ClientApp's mod decodes and encodes
it) and any message whose batched run fails run as before, one message at a time, through the ClientApp (a failure
is logged once per kind and run). The in-process engine frees the cohort's steps at the end of each run
(:func:`release`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from logging import WARNING

import torch
from flwr.app import Context, Message, MessageType
from flwr.common.logger import log
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from client_app.app import node_partition
from client_app.wire_codec import encoded
from client_app.work import load_task, update_message
from common.training import LocalRecipe, epoch_batches
from strategies import client_side
from strategies.client import ClientSide, LocalTask

ADAM_BETAS, ADAM_EPS = (0.9, 0.999), 1e-8  # torch.optim.Adam's defaults, which make_optimizer uses
CUDA_GRAPHS = True  # capture each cohort step on CUDA (benchmarks/cohort_speed.py turns it off to measure what it buys)


def served(task: LocalTask) -> bool:
    """Whether `task` runs the standard local recipe on a model the batched computation reproduces (a node with no
    training data is left to the ClientApp, whose error reply says so)."""
    if (type(client_side(task.config)) is not ClientSide or task.recipe.local_objective != "cross-entropy"
            or len(task.parts["train"]) == 0):
        return False
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                   or (isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0)
                   or (isinstance(getattr(m, "dropout", None), float) and m.dropout > 0)  # attention's own
                   for m in task.model.modules())


@dataclass
class Member:
    """One client of a cohort: its message, its task and its start (flat, on the model's device)."""

    msg: Message
    task: LocalTask
    start: torch.Tensor


def train_cohort(messages: Sequence[Message], contexts: Mapping[int, Context]) -> dict[str, Message]:
    """Replies to the train messages among `messages` that cohort training serves, by message id; the others (and
    any whose batched run fails) are left to the ClientApp."""
    groups: dict[tuple, list[Member]] = {}
    for msg in messages:
        context = contexts.get(msg.metadata.dst_node_id)
        if (msg.metadata.message_type != MessageType.TRAIN or context is None
                or float(context.node_config.get("latency-s", 0.0)) or encoded(msg)):
            continue
        try:
            task = load_task(msg, context, *node_partition(context), {})
        except Exception:  # noqa: BLE001 - the ClientApp will run it and reply with the error
            continue
        if served(task):
            # load_task reuses one model per configuration: the start is copied before the next message loads
            groups.setdefault((id(task.model), task.recipe), []).append(Member(msg, task, task.spec.flatten(
                task.model).to(task.device)))
    replies = {}
    for members in groups.values():
        try:
            deltas, metrics = train_together(members)
        except Exception as err:  # noqa: BLE001 - one at a time instead, where a failure stays the client's own
            fell_back("a cohort's batched training failed", err, f"its {len(members)} clients train one at a time")
            continue
        for member, delta, stats in zip(members, deltas, metrics):
            member.task.metrics.update(stats)
            replies[member.msg.metadata.message_id] = update_message(member.msg, member.task, delta.cpu())
    return replies


def train_together(members: Sequence[Member]) -> tuple[torch.Tensor, list[dict[str, float]]]:
    """The local runs of `members` (one model, one recipe) as one batched computation: each one's delta (C, P)
    and training metrics, as :func:`common.training.train` computes them."""
    task = members[0].task
    recipe, device = task.recipe, task.device
    C, B = len(members), recipe.batch_size
    # every client's batches, as run_epochs draws them, padded to the longest run and the batch size
    batches = [[idx for epoch in epoch_batches(len(m.task.parts["train"]), B, recipe.local_epochs,
                                               m.task.train_seed) for idx in epoch] for m in members]
    T = max(len(b) for b in batches)
    index = torch.zeros(C, T, B, dtype=torch.long)
    valid = torch.zeros(C, T, B, dtype=torch.bool)
    for c, runs in enumerate(batches):
        for t, idx in enumerate(runs):
            index[c, t, :len(idx)], valid[c, t, :len(idx)] = idx, True
    n_max = max(len(m.task.parts["train"]) for m in members)
    dtype = members[0].start.dtype  # the model's (float32 on the wire; the tests also train in float64)
    x = torch.zeros(C, n_max, *task.parts["train"].x.shape[1:], dtype=dtype)
    y = torch.zeros(C, n_max, dtype=torch.long)
    for c, m in enumerate(members):
        part = m.task.parts["train"]
        x[c, :len(part)], y[c, :len(part)] = torch.from_numpy(part.x), torch.from_numpy(part.y)
    x, y, index, valid = (t.to(device) for t in (x, y, index, valid))
    rows = torch.arange(C, device=device)[:, None, None]
    xs, ys, masks = x[rows, index], y[rows, index], valid.to(dtype)  # (C, T, B, ...): every step's batch
    active = valid.any(dim=2)  # (C, T): the client takes step t
    starts = torch.stack([m.start for m in members])
    step = _step_for(task, C, tuple(xs.shape[3:]), dtype)
    step.reset(starts)
    for t in range(T):
        step(xs[:, t], ys[:, t], masks[:, t], active[:, t])
    metrics = [{"train-loss": loss / max(n, 1), "train-accuracy": hit / max(n, 1)}
               for loss, hit, n in zip(step.ce_sum.tolist(), step.hits.tolist(), valid.sum(dim=(1, 2)).tolist())]
    return step.w - starts, metrics


class CohortStep:
    """One local step of C clients, in place on its own tensors: the parameters ``w`` (C, P), the optimizer's state,
    and the summed loss and hits. On CUDA the step is captured once as a CUDA graph and replayed (one launch instead
    of a Python-driven vmap's hundreds); elsewhere, or if capture fails, it runs eagerly."""

    def __init__(self, task: LocalTask, C: int, sample_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        model, spec, self.recipe, device = task.model, task.spec, task.recipe, task.device
        B = self.recipe.batch_size

        def batch_loss(w: torch.Tensor, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor
                       ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
            """One client's mean cross-entropy over its batch's real rows, with its summed loss and hits."""
            params = {n: chunk.view(shape) for n, chunk, shape in zip(spec.names, w.split(spec.sizes), spec.shapes)}
            logits = functional_call(model, params, (xb,), strict=False)
            ce = F.cross_entropy(logits, yb, reduction="none") * mask
            hits = ((logits.argmax(1) == yb) & mask.bool()).sum()
            return ce.sum() / mask.sum().clamp(min=1), (ce.detach().sum(), hits)

        self.model, self.grads = model, vmap(grad(batch_loss, has_aux=True))
        self.w = torch.zeros(C, spec.numel, device=device, dtype=dtype)
        self.state = optimizer_state(self.recipe, self.w)
        self.ce_sum = torch.zeros(C, device=device, dtype=dtype)
        self.hits = torch.zeros(C, device=device, dtype=torch.long)
        self.xb = torch.zeros(C, B, *sample_shape, device=device, dtype=dtype)
        self.yb = torch.zeros(C, B, device=device, dtype=torch.long)
        self.mask = torch.zeros(C, B, device=device, dtype=dtype)
        self.on = torch.zeros(C, device=device, dtype=torch.bool)
        self.graph = self._capture() if device.type == "cuda" and CUDA_GRAPHS else None

    def _compute(self) -> None:
        g, (ce, hit) = self.grads(self.w, self.xb, self.yb, self.mask)
        optimizer_step(self.recipe, self.state, self.w, g, self.on)
        self.ce_sum += ce
        self.hits += hit

    def _capture(self) -> torch.cuda.CUDAGraph | None:
        """The step as a CUDA graph, warmed up on a side stream first (as torch.cuda.graphs asks); None if capture
        fails (the step then runs eagerly)."""
        tensors = [self.w, *self.state.values(), self.ce_sum, self.hits]
        saved = [t.clone() for t in tensors]
        try:
            self.model.train()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    self._compute()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._compute()
        except Exception as err:  # noqa: BLE001 - eager steps compute the same
            fell_back("capturing a cohort step as a CUDA graph failed", err, "the step runs eagerly")
            graph = None
        for t, s in zip(tensors, saved):
            t.copy_(s)
        return graph

    def reset(self, starts: torch.Tensor) -> None:
        """Start the clients' runs from `starts` (C, P) with fresh optimizer state and sums."""
        self.w.copy_(starts)
        for t in (*self.state.values(), self.ce_sum, self.hits):
            t.zero_()

    def __call__(self, xb: torch.Tensor, yb: torch.Tensor, mask: torch.Tensor, on: torch.Tensor) -> None:
        for static, value in ((self.xb, xb), (self.yb, yb), (self.mask, mask), (self.on, on)):
            static.copy_(value)
        self.model.train()
        if self.graph is not None:
            self.graph.replay()
        else:
            self._compute()


_STEPS: dict[tuple, CohortStep] = {}  # by model, recipe, cohort size and sample shape: captured graphs are reused
_REPORTED: set[tuple[str, str]] = set()  # the fallbacks already logged (what, exception type)


def fell_back(what: str, err: Exception, instead: str) -> None:
    """Log a fallback once per kind of failure and run: an out-of-memory error that turns the speed-up off is
    said, not silent, and not repeated at every step."""
    if (what, type(err).__name__) not in _REPORTED:
        _REPORTED.add((what, type(err).__name__))
        log(WARNING, "%s (%s: %s); %s (said once per run)", what, type(err).__name__, err, instead)


def release() -> None:
    """Free what the cohort keeps between steps, at a run's end: its steps (each holding the model, C copies of
    the parameters and optimizer state, and on CUDA a captured graph and its memory pool)."""
    _STEPS.clear()
    _REPORTED.clear()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _step_for(task: LocalTask, C: int, sample_shape: tuple[int, ...], dtype: torch.dtype) -> CohortStep:
    key = (id(task.model), task.recipe, C, sample_shape, dtype, task.device, CUDA_GRAPHS)
    if key not in _STEPS:
        if len(_STEPS) >= 32:  # cohort sizes vary from step to step; keep the recent ones
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[key] = CohortStep(task, C, sample_shape, dtype)
    return _STEPS[key]


def optimizer_state(recipe: LocalRecipe, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-client optimizer state for `w` (C, P): Adam's moments or SGD's momentum buffer, and step counts."""
    count = torch.zeros(w.shape[0], 1, device=w.device, dtype=w.dtype)
    if recipe.optimizer == "adam":
        return {"m": torch.zeros_like(w), "v": torch.zeros_like(w), "steps": count}
    return {"buf": torch.zeros_like(w), "steps": count}


def optimizer_step(recipe: LocalRecipe, state: dict[str, torch.Tensor], w: torch.Tensor, g: torch.Tensor,
                   active: torch.Tensor) -> None:
    """One step of torch.optim's SGD (momentum, no dampening) or Adam (default betas and eps), in place, for every
    client in `active` (C,); the others keep their parameters and state."""
    on = active[:, None]
    steps = state["steps"]
    steps.add_(on.to(w.dtype))
    if recipe.optimizer == "adam":
        beta1, beta2 = ADAM_BETAS
        m, v = state["m"], state["v"]
        m.copy_(torch.where(on, beta1 * m + (1 - beta1) * g, m))
        v.copy_(torch.where(on, beta2 * v + (1 - beta2) * g * g, v))
        k = steps.clamp(min=1)
        new = w - (recipe.lr / (1 - beta1 ** k)) * m / (v.sqrt() / (1 - beta2 ** k).sqrt() + ADAM_EPS)
    else:  # SGD: the first step's buffer is the gradient itself
        buf = state["buf"]
        buf.copy_(torch.where(on, torch.where(steps == 1, g, recipe.momentum * buf + g), buf))
        new = w - recipe.lr * buf
    w.copy_(torch.where(on, new, w))
