"""What the DDP agent (kubetrain/trainer/ddp/agent.py) makes of torch's launcher's logs: a rendezvous that fails
to shut down after the group ended is one line, not a traceback that reads as the job's cause."""

from __future__ import annotations

import io
import logging

from kubetrain.trainer.ddp.agent import RDZV_SHUTDOWN_FAILED, quiet_rendezvous_shutdown


def test_a_failed_rendezvous_shutdown_is_one_warning_line_and_other_errors_keep_their_traceback():
    launcher = logging.getLogger("torch.distributed.launcher.api")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    launcher.addHandler(handler)
    try:
        quiet_rendezvous_shutdown()
        quiet_rendezvous_shutdown()  # once only
        assert len(launcher.filters) == 1
        try:
            raise RuntimeError("The server socket has failed to listen\non any local network address")
        except RuntimeError:
            launcher.exception(RDZV_SHUTDOWN_FAILED)
            launcher.exception("something else")
    finally:
        launcher.removeHandler(handler)
        launcher.filters.clear()
    first, *rest = out.getvalue().splitlines()
    assert first == (f"WARNING torch.distributed.launcher.api: {RDZV_SHUTDOWN_FAILED}: "
                     "RuntimeError: The server socket has failed to listen")
    assert rest[0] == "ERROR torch.distributed.launcher.api: something else" and "Traceback" in rest[1]
