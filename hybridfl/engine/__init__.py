"""The in-process engine: the ServerApp and the ClientApp in one process, no Flower transport between them
(inprocess.py), a pull's clients trained as one batched computation (cohort.py)."""
