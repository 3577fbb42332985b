"""kubetrain's control plane: API model, planner, policies, status, operator, local backend, CLI.

Nothing here imports torch: the operator image carries no torch.
"""

__version__ = "0.1.0"
