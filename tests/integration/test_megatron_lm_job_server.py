"""The Megatron-LM job server's own contract: a job whose rank 0 loses the probed rendezvous port to another
process (the port is free when probed and taken before rank 0 binds it) is started again on another port."""
import socket
import textwrap

import pytest

from tests.helpers import megatron_lm_server

pytestmark = pytest.mark.megatron_independent

RENDEZVOUS = textwrap.dedent("""
    import datetime, os
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          os.environ["RANK"] == "0", timeout=datetime.timedelta(seconds=20))
    store.set(f"rank{os.environ['RANK']}", "here")
    store.wait([f"rank{rank}" for rank in range(int(os.environ["WORLD_SIZE"]))])
    print("met on", os.environ["MASTER_PORT"], flush=True)
""")


def test_a_job_whose_rendezvous_port_was_taken_starts_again_on_another(tmp_path, monkeypatch):
    script = tmp_path / "rendezvous.py"
    script.write_text(RENDEZVOUS)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken, megatron_lm_server.free_port()])
        monkeypatch.setattr(megatron_lm_server, "free_port", lambda: next(ports))
        request = {"script": str(script), "processes": 2, "args": [], "env": {"PATH": "/usr/bin:/bin"},
                   "cwd": str(tmp_path), "timeout": 60, "log": str(tmp_path / "rank")}
        result = megatron_lm_server._run_job(request)
    logs = [(tmp_path / f"rank.{rank}").read_text() for rank in range(2)]
    assert result == {"codes": [0, 0], "timed_out": False}, logs
    assert all("met on" in log and str(taken) not in log and "EADDRINUSE" not in log for log in logs), logs
