"""A private directory per vLLM server for its ZeroMQ IPC sockets, removed when the server stops. [stdlib only]

vLLM's API server and engine core talk over ``ipc://$VLLM_RPC_BASE_PATH/<uuid4>`` sockets, and
``VLLM_RPC_BASE_PATH`` defaults to the temp directory: each 1P x 1D cluster left 14 socket files in /tmp when
it stopped (measured on vLLM for CPU 0.32; a process that is killed unlinks nothing), thousands over a day of
CI. So each vLLM server the plugin starts gets its own short directory in the temp directory (short: a Unix
socket path has 107 bytes at most, and vLLM's uuid takes 36 of them), and whoever stops the server removes it:
`ServerProcess.stop`, the reuse keeper, or the next run sweeping a dead keeper's cluster. The path to remove may
come from a state file, so removal goes by proof, not by name (:mod:`pytest_pdserve.common.created`): the directory
must carry the marker written when it was made, and only the sockets in it go. A ``VLLM_RPC_BASE_PATH`` the user
set is left alone. The keeper imports this module under ``python -I -S``: the standard library only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from pytest_pdserve.common import created

__all__ = ["RPC_BASE_ENV", "RPC_DIR_PREFIX", "make_rpc_dir", "remove_rpc_dir"]

RPC_BASE_ENV = "VLLM_RPC_BASE_PATH"
RPC_DIR_PREFIX = "pdserve-rpc-"


def make_rpc_dir() -> Path:
    """A new private (0700) directory ``<tmp>/pdserve-rpc-XXXXXXXX`` for one server's IPC sockets, marked as
    pdserve's (:data:`~pytest_pdserve.common.created.RPC`)."""
    return created.make_unique_dir(Path(tempfile.gettempdir()), RPC_DIR_PREFIX.rstrip("-"), 0o700, created.RPC)


def remove_rpc_dir(path: str | os.PathLike[str] | None) -> None:
    """Remove a directory :func:`make_rpc_dir` made (once its server is gone), with the sockets in it; anything
    else is left alone: a directory without its marker (another name, a link, one of the user's: the path comes
    from a state file too) or a file in it that is not a socket."""
    if path:
        created.remove_tree(Path(path), created.RPC, sockets=True)
