"""`kubetrain.Client` and its types: the job (`Job`, the typed status), `Event`, `JobHandle`, and the errors
(`ClientError` and its kinds). The implementation is the control plane's (kubetrain_operator.client);
docs/client.md is the guide."""

from kubetrain_operator.client import (  # noqa: F401  (re-exported)
    Client, ClientError, Event, Forbidden, InvalidManifest, Job, JobEnded, JobExists, JobHandle, JobNotFound,
    WaitTimeout, __all__,
)
