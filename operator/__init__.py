"""kubetrain's control plane: the API model (api), the pure engine (core: plan, policies, status), the kopf
operator (controller), the local backend (local), the Python client (client) and the reports (report).

Nothing here imports torch: the operator image carries no torch.
"""

__version__ = "0.1.0"
