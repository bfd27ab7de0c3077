"""What ``import ascendspeed.megatron_adaptor`` does, as functions tests can call and undo."""
from __future__ import annotations

import argparse
from importlib.metadata import PackageNotFoundError, version

from ascendspeed.patching import MANAGER, PatchManager, release

#: The tested megatron-core releases, [lowest, highest): every minor release from 0.15 to 0.19.
SUPPORTED_MEGATRON_CORE = ("0.15.0", "0.20.0")
#: What to install: the newest release for each Python (0.17 and newer need Python 3.12).
INSTALL_HINT = ("pip install 'megatron-core==0.19.2' (Python >= 3.12), or 'megatron-core==0.16.1' "
                "(the newest release for Python 3.10 and 3.11)")


def check_megatron_core_version() -> str:
    """The installed megatron-core version; an ImportError naming the supported range otherwise."""
    low, high = SUPPORTED_MEGATRON_CORE
    try:
        found = version("megatron-core")
    except PackageNotFoundError:
        raise ImportError(
            f"ascendspeed needs megatron-core >={low},<{high}; it is not installed: {INSTALL_HINT}"
        ) from None
    if not release(low) <= release(found) < release(high):
        raise ImportError(
            f"ascendspeed supports megatron-core >={low},<{high} (0.15 to 0.19), found {found}; "
            f"install a supported release: {INSTALL_HINT}"
        )
    return found


def install(manager: PatchManager = MANAGER) -> None:
    """Version check, device shims, Megatron-LM argument hooks. Idempotent: the manager applies a patch
    once, and the device is selected once until ``uninstall``."""
    check_megatron_core_version()
    from ascendspeed import accelerator
    from ascendspeed.integration import megatron_lm

    accelerator.install(manager)
    megatron_lm.install(manager)


def uninstall(manager: PatchManager = MANAGER) -> None:
    """Revert every ascendspeed patch (features, device shims, argument hooks) and forget the device."""
    from ascendspeed import accelerator

    manager.revert()
    accelerator.uninstall(manager)


def build_list_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m ascendspeed.megatron_adaptor``: every feature flag, and the Megatron-LM
    flags features read (``feature_parser``: the choices and types ``enable_features`` checks too), so a
    training command line's feature flags can be pasted after ``--list``."""
    from ascendspeed.features import feature_parser

    parser = argparse.ArgumentParser(
        prog="python -m ascendspeed.megatron_adaptor",
        description="Show what ascendspeed patches, optionally with features switched on by their flags.",
        parents=[feature_parser()],
    )
    parser.add_argument("--list", action="store_true", help="print the applied patches")
    parser.add_argument("--markdown", action="store_true", help="with --list, print a Markdown table")
    return parser


PATCH_TABLE_MARKERS = ("<!-- patch table: start -->", "<!-- patch table: end -->")


def every_patch() -> list[dict]:
    """A row for every patch ascendspeed can apply, whatever the device and megatron-core release: the CPU
    and NPU shims, the Megatron-LM hooks, and each feature's patches with its ``example_flags`` on."""
    from ascendspeed import accelerator
    from ascendspeed.accelerator import cpu_half_gemm, triton_guard
    from ascendspeed.features import all_features
    from ascendspeed.integration import megatron_lm
    from ascendspeed.patching.manager import patch_row

    groups = [
        (accelerator.CPU_FEATURE, accelerator.cpu_patches() + ([] if triton_guard.patches() else
                                                               triton_guard.guard_patches())),
        (accelerator.GLOO_P2P_FEATURE, accelerator.gloo_p2p_patches()),
        (accelerator.CPU_HALF_GEMM_FEATURE, accelerator.cpu_half_gemm_patches(cpu_half_gemm.HALF_DTYPES)),
        (accelerator.NPU_FEATURE, triton_guard.guard_patches()),
        (accelerator.TE_FALLBACK_FEATURE, accelerator.te_fallback_patches()),
        (accelerator.MAMBA_FALLBACK_FEATURE, accelerator.mamba_fallback_patches()),
        (accelerator.GDN_FALLBACK_FEATURE, accelerator.gdn_fallback_patches()),
        (accelerator.TORCH_ADAM_FEATURE, accelerator.torch_adam_patches()),
        (accelerator.MODEL_SPACE_CHECKPOINTS_FEATURE, accelerator.model_space_checkpoints_patches()),
        (megatron_lm.FEATURE_NAME, megatron_lm.patches()),
    ]
    parser = build_list_parser()
    for feature in all_features():
        args = parser.parse_args(list(feature.example_flags))
        settings = feature.settings(args)
        groups.append((feature.name, feature.patches(settings, feature.new_state(settings))))
    return [patch_row(name, patch) for name, patches in groups for patch in patches]


def write_patch_table(path: str) -> bool:
    """Replace the table between ``PATCH_TABLE_MARKERS`` in ``path``; True when it changed."""
    from ascendspeed.patching.manager import format_rows

    start, end = PATCH_TABLE_MARKERS
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    head, found, rest = text.partition(start)
    _, found_end, tail = rest.partition(end)
    if not (found and found_end):
        raise SystemExit(f"{path} has no {start} ... {end} section to write the table into")
    new = f"{head}{start}\n{format_rows(every_patch(), markdown=True)}\n{end}{tail}"
    if new != text:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(new)
    return new != text


def main(argv=None) -> None:
    from ascendspeed.features import FeatureArgumentError, apply_features
    from ascendspeed.patching.manager import format_rows

    parser = build_list_parser()
    parser.add_argument("--table", action="store_true",
                        help="print every patch ascendspeed can apply (all devices, features and releases)")
    parser.add_argument("--write-table", metavar="PATH",
                        help="write that table into PATH between its patch-table markers (docs/patching.md)")
    args = parser.parse_args(argv)
    if args.table or args.write_table:
        if args.write_table:
            changed = write_patch_table(args.write_table)
            print(f"{args.write_table}: {'updated' if changed else 'already up to date'}")
        else:
            print(format_rows(every_patch(), markdown=True))
        return
    if not args.list:
        parser.print_help()
        return
    install()
    try:
        apply_features(args)
    except FeatureArgumentError as error:
        parser.error(str(error))
    print(MANAGER.format_report(markdown=args.markdown))
