"""A user's own federated task on hybridfl: a tabular dataset and an MLP, named by import path in the presets."""
