"""A free TCP port on the loopback interface, for jobs whose ranks meet at MASTER_PORT (torchrun,
Megatron-LM's env:// initialisation). Only the standard library: the Megatron-LM server imports it before
anything else."""
import socket


def free_port() -> int:
    """A port nobody listens on now. Another process may take it before the job binds it; jobs that can
    meet through a file (``init_method="file://..."``) should, as ``tests.helpers.distributed`` does."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
