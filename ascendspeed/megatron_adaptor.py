"""``import ascendspeed.megatron_adaptor`` as the first line of a training script switches ascendspeed on.

The import checks the megatron-core version, selects the device (NPU, CUDA or CPU) and installs its
shims, and hooks Megatron-LM's argument parsing so that ascendspeed's flags are accepted and the
features they select are validated and applied right after Megatron's own ``validate_args``.
Importing it again does nothing more. megatron-core users without Megatron-LM call
``ascendspeed.features.enable_features(...)`` after this import.

``python -m ascendspeed.megatron_adaptor --list [feature flags]`` prints what is patched.
"""
from ascendspeed.adaptor import install, uninstall

install()

__all__ = ["install", "uninstall"]

if __name__ == "__main__":
    from ascendspeed.adaptor import main

    main()
