"""Device selection (npu / cuda / cpu) and the shims each device needs. (Being written.)"""
import os

from ascendspeed.patching import MANAGER, PatchManager


def select_device() -> str:
    forced = os.environ.get("ASCENDSPEED_DEVICE")
    if forced:
        return forced
    return "cpu"


def install(manager: PatchManager = MANAGER) -> str:
    return select_device()
