"""The adaptor entry: version gate, idempotent import, report, and the Megatron-LM argument hooks."""
import argparse
import importlib
import os
import subprocess
import sys

import pytest

import ascendspeed.megatron_adaptor  # noqa: F401 - the import under test
from ascendspeed import adaptor
from ascendspeed.patching import MANAGER
from tests.helpers.megatron_lm import add_megatron_lm_to_path


def test_importing_the_adaptor_twice_changes_nothing():
    before = MANAGER.report()
    importlib.reload(ascendspeed.megatron_adaptor)
    adaptor.install()
    assert MANAGER.report() == before


@pytest.mark.parametrize("found", ["0.12.0", "0.14.9", "0.20.0", "1.0.0"])
def test_unsupported_megatron_core_names_the_supported_range(monkeypatch, found):
    monkeypatch.setattr(adaptor, "version", lambda name: found)
    with pytest.raises(ImportError, match=rf"supports megatron-core >=0\.15\.0,<0\.20\.0 \(0\.15 to 0\.19\), "
                                          rf"found {found}"):
        adaptor.check_megatron_core_version()


@pytest.mark.parametrize("found", ["0.15", "0.16", "0.16.1rc0", "0.19.2"])
def test_release_numbers_without_a_patch_number_or_with_a_suffix_are_read(monkeypatch, found):
    monkeypatch.setattr(adaptor, "version", lambda name: found)
    assert adaptor.check_megatron_core_version() == found


@pytest.mark.parametrize("flags, message", [
    (["--use-fused-swiglu"], "--use-fused-swiglu needs --swiglu"),
    (["--position-embedding-type", "foo"], "invalid choice: 'foo'"),
    (["--alibi-fused-attention"], "--alibi-fused-attention needs --position-embedding-type alibi"),
])
def test_list_entry_point_refuses_bad_flags_with_a_usage_error(flags, message):
    done = subprocess.run(
        [sys.executable, "-m", "ascendspeed.megatron_adaptor", "--list", *flags],
        capture_output=True, text=True, env={**os.environ, "ASCENDSPEED_DEVICE": "cpu"},
    )
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_installed_megatron_core_is_supported():
    from importlib.metadata import version

    assert adaptor.check_megatron_core_version() == version("megatron-core")


def test_list_entry_point_prints_the_patches():
    out = subprocess.run(
        [sys.executable, "-m", "ascendspeed.megatron_adaptor", "--list"],
        capture_output=True, text=True, check=True, env={**os.environ, "ASCENDSPEED_DEVICE": "cpu"},
    ).stdout
    assert "megatron.training.arguments:validate_args" in out
    assert "megatron_lm" in out


@pytest.mark.megatron_lm
def test_megatron_lm_parser_knows_ascendspeed_flags():
    add_megatron_lm_to_path()
    from megatron.training import arguments

    parser = arguments.add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    from ascendspeed.features import all_features

    for feature in all_features():
        probe = argparse.ArgumentParser(add_help=False)
        feature.add_arguments(probe)
        for action in probe._actions:
            for flag in action.option_strings:
                assert flag in parser._option_string_actions, f"{flag} of {feature.name} not registered"
