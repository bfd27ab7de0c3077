"""The lock that keeps a second run out of a ``--save`` directory in use (standard library only, so any
process can take or test it without importing megatron)."""
from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path
from typing import Optional

from ascendspeed.training.errors import CheckpointError

LOCK_FILE = ".ascendspeed_save.lock"


class SaveDirectoryLock:
    """An exclusive ``flock`` on ``--save``/.ascendspeed_save.lock, held by rank 0 for the run's lifetime.

    Two runs saving into one directory overwrite each other's checkpoints while both report success. The
    kernel drops the lock when its process ends, however it ends, so a crashed or killed run never leaves
    the directory locked; the file only names the last holder."""

    def __init__(self, directory: Path):
        self.path = directory / LOCK_FILE
        self.handle = None

    def acquire(self) -> Optional[str]:
        """Take the lock, or raise ``CheckpointError`` naming its holder. Returns a warning where the file
        system cannot lock (some network file systems), instead of failing the run."""
        handle = open(self.path, "a+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "a process that has not written its name yet"
            handle.close()
            raise CheckpointError(
                f"--save {self.path.parent} is in use by another run ({holder}): two runs saving into one "
                f"directory overwrite each other's checkpoints. Wait for that run to end or stop it, or choose "
                f"another --save (a run that crashed holds nothing: the lock ends with its process)") from None
        except OSError as cause:
            handle.close()
            return (f"warning: cannot lock {self.path} ({type(cause).__name__}: {cause}; the file system may not "
                    f"support flock): a second run on --save {self.path.parent} would not be refused")
        handle.seek(0)
        handle.truncate()
        handle.write(f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.flush()
        self.handle = handle
        return None

    def release(self) -> None:
        if self.handle is not None:
            fcntl.flock(self.handle.fileno(), fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None
