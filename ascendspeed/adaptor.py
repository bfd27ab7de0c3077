"""What ``import ascendspeed.megatron_adaptor`` does, as functions tests can call and undo."""
from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

from ascendspeed.patching import MANAGER, PatchManager

SUPPORTED_MEGATRON_CORE = ("0.16.0", "0.17.0")  # [lowest, highest) tested release range
_installed = False


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_megatron_core_version() -> str:
    """The installed megatron-core version; an ImportError naming the supported range otherwise."""
    low, high = SUPPORTED_MEGATRON_CORE
    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        raise ImportError(
            f"ascendspeed needs megatron-core >={low},<{high}; it is not installed "
            f"(pip install megatron-core==0.16.1)"
        ) from None
    if not _version_tuple(low) <= _version_tuple(found) < _version_tuple(high):
        raise ImportError(
            f"ascendspeed supports megatron-core >={low},<{high}, found {found}; "
            f"install a supported release (pip install megatron-core==0.16.1)"
        )
    return found


def install(manager: PatchManager = MANAGER) -> None:
    """Idempotent: version check, device shims, Megatron-LM argument hooks."""
    global _installed
    if _installed:
        return
    check_megatron_core_version()
    from ascendspeed import accelerator
    from ascendspeed.integration import megatron_lm

    accelerator.install(manager)
    megatron_lm.install(manager)
    _installed = True


def uninstall(manager: PatchManager = MANAGER) -> None:
    """Revert every ascendspeed patch (features, device shims, argument hooks)."""
    global _installed
    manager.revert()
    _installed = False


def main(argv=None) -> None:
    from ascendspeed.features import add_feature_arguments, apply_features, default_arguments

    parser = argparse.ArgumentParser(
        prog="python -m ascendspeed.megatron_adaptor",
        description="Show what ascendspeed patches, optionally with features switched on by their flags.",
    )
    parser.add_argument("--list", action="store_true", help="print the applied patches")
    add_feature_arguments(parser, extend_megatron=False)
    for dest, default in vars(default_arguments()).items():
        flag = "--" + dest.replace("_", "-")
        if flag not in parser._option_string_actions:
            if isinstance(default, bool):
                parser.add_argument(flag, action="store_true", default=default)
            else:
                parser.add_argument(flag, type=type(default) if default is not None else str, default=default)
    args = parser.parse_args(argv)
    if not args.list:
        parser.print_help()
        return
    install()
    apply_features(args)
    print(MANAGER.format_report())
