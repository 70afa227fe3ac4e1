"""Option sets shared by test_optim.py and test_fusion.py (a helper module, not
a test module: pytest puts this directory on sys.path for both)."""

# One option set per optimizer with every state slot in use, for the tests
# that are not about the option grid.
RICH = {
    "SGD": {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    "Adam": {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.01},
    "AdamW": {"lr": 1e-2, "amsgrad": True, "weight_decay": 0.1},
    "Adagrad": {"lr": 0.05, "lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1},
    "RMSprop": {"lr": 1e-3, "momentum": 0.9, "centered": True, "weight_decay": 0.01},
    "Adadelta": {"lr": 1.0, "rho": 0.9, "weight_decay": 0.01},
}
