"""The task: scikit-learn's breast-cancer table (569 patients, 30 features, 2 classes; it ships inside the
scikit-learn wheel, so nothing is downloaded) and a small MLP. hybridfl calls both by import path:
``dataset = "tabular_task.task:breast_cancer"``, ``model = "tabular_task.task:mlp"``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from torch import nn


def breast_cancer(root: Path) -> tuple[np.ndarray, np.ndarray]:
    """(x, y): the 30 features standardised (a fixed transform of the whole table: every node computes the
    same one, so it is no leak between clients) and the labels 0 = malignant, 1 = benign. `root` (the run's
    data-root) is not needed: the table ships with scikit-learn."""
    from sklearn.datasets import load_breast_cancer

    data = load_breast_cancer()
    x = data.data.astype(np.float32)
    x = (x - x.mean(0)) / x.std(0)
    return x, data.target.astype(np.int64)


class MLP(nn.Module):
    """Two hidden layers; ``features`` is what the head sees (the out-of-domain methods fit their own head on
    it), and the head is registered last (the methods that treat the head apart take the last arrays)."""

    def __init__(self, inputs: int, num_classes: int, hidden: int = 32) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU())
        self.head = nn.Linear(hidden, num_classes)

    def features(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def mlp(input_shape: tuple[int, ...], num_classes: int) -> MLP:
    """hybridfl's model factory contract: one sample's shape and the number of classes."""
    (inputs,) = input_shape
    return MLP(inputs, num_classes)
