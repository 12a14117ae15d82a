"""The batched local step: C clients' local training, one step at a time, as one computation (hybridfl/engine/cohort.py
builds the cohorts and their batches).

Each client's trainable parameters are a row of one (C, P) tensor; a step is one ``torch.func.vmap`` over
``functional_call`` of the shared model, each client on its own batch with its own optimizer state, and the
optimizer's update is a functional kernel of torch.optim's step (:func:`optimizer_step`) with the settings
:func:`common.training.make_optimizer` gives torch.optim: the same arithmetic as :func:`common.training.train`, up
to the order of float sums. A client whose run is over keeps its parameters and optimizer state.
"""

from __future__ import annotations

from logging import WARNING

import torch
from flwr.common.logger import log
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from common.params import ParamSpec
from common.training import ADAM_BETAS, ADAM_EPS, LocalRecipe

CUDA_GRAPHS = True  # capture each cohort step on CUDA (benchmarks/cohort_speed.py turns it off to measure what it buys)


class CohortStep:
    """One local step of C clients, in place on its own tensors: the parameters ``w`` (C, P), the optimizer's state,
    and the summed loss and hits. On CUDA the step is captured once as a CUDA graph and replayed (one launch instead
    of a Python-driven vmap's hundreds); elsewhere, or if capture fails, it runs eagerly."""

    def __init__(self, model: nn.Module, spec: ParamSpec, recipe: LocalRecipe, device: torch.device, C: int,
                 sample_shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.recipe = recipe
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


def step_for(model: nn.Module, spec: ParamSpec, recipe: LocalRecipe, device: torch.device, C: int,
             sample_shape: tuple[int, ...], dtype: torch.dtype) -> CohortStep:
    """The step for C clients of `model` under `recipe` (kept for the next cohort of that shape)."""
    key = (id(model), recipe, C, sample_shape, dtype, device, CUDA_GRAPHS)
    if key not in _STEPS:
        if len(_STEPS) >= 32:  # cohort sizes vary from step to step; keep the recent ones
            _STEPS.pop(next(iter(_STEPS)))
        _STEPS[key] = CohortStep(model, spec, recipe, device, C, sample_shape, dtype)
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
        beta1, beta2 = ADAM_BETAS  # torch.optim.Adam's step, as make_optimizer sets it
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
