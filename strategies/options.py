"""The options several methods share, declared once: each method's ``Config`` takes the field
(``server_lr: float = SERVER_LR.field()``), so the key, its default, its check and its help are the same in every
method that has it, and no method imports another's file for a constant."""

from __future__ import annotations

from common.config import COUNT, POSITIVE, Option, Range

BUFFER_SIZE = Option(10, COUNT, "K, updates per step (papers' grid 10, 20, 50)")
SERVER_LR = Option(1.0, POSITIVE, "server learning rate η_g of the buffered step (Feddle: of its FedBuff "
                                  "fallback; grid 0.01, 0.1, 1), or η_s of generalised FedAvg's SERVEROPT (fedopt, "
                                  "data mixing)")
STALENESS_EXPONENT = Option(0.5, Range(0), "a of the staleness weight (1 + τ)^−a (FedAsync grid 0.1, 0.5, 0.9)")
SERVER_TRAIN_LR = Option(1e-3, POSITIVE, "the server's training learning rate (FedDF: of the distillation; "
                                         "grid 1e-5, 1e-4, 1e-3)")
SERVER_TRAIN_EPOCHS = Option(1, COUNT, "the server's epochs per step (grid 1, 10, 20)")
GLOBAL_MODELS = Option(5, COUNT, "d, the global models (FedMerge: merged per client, paper 5-30, code 5; IFCA: "
                                 "clusters; FedEM: components)")
