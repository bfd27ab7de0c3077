"""The patch manager on small throwaway modules written to a temporary directory."""
import importlib
import inspect
import sys
import textwrap

import pytest

from ascendspeed.patching import EXISTS, PatchError, PatchManager, describe_signature, replace, wrap

pytestmark = pytest.mark.megatron_independent  # one release covers it: .ci/run runs it on the newest only

TARGET_SOURCE = """
def scale(x, factor=2):
    return x * factor

class Layer:
    def forward(self, x):
        return x + 1

class Child(Layer):
    pass

LIMIT = 3
"""

CONSUMER_SOURCE = """
from {target} import scale, Layer

def use(x):
    return scale(x)
"""


@pytest.fixture
def modules(tmp_path, request):
    """Unique module names per test so the import system never hands back a cached module."""
    suffix = request.node.name.replace("[", "_").replace("]", "_").replace("-", "_")
    target, consumer = f"tgt_{suffix}", f"use_{suffix}"
    (tmp_path / f"{target}.py").write_text(textwrap.dedent(TARGET_SOURCE))
    (tmp_path / f"{consumer}.py").write_text(textwrap.dedent(CONSUMER_SOURCE.format(target=target)))
    sys.path.insert(0, str(tmp_path))
    manager = PatchManager()
    yield manager, target, consumer
    manager.revert()
    sys.path.remove(str(tmp_path))
    for name in (target, consumer):
        sys.modules.pop(name, None)


SCALE = "(x, factor=2)"


def tripled(x, factor=2):
    return x * 3


def add_one(original):
    def wrapper(x, factor=2):
        return original(x, factor) + 1

    return wrapper


def times_ten(original):
    def wrapper(x, factor=2):
        return original(x, factor) * 10

    return wrapper


def test_patch_after_import_sweeps_stale_copies(modules):
    manager, target, consumer = modules
    tgt = importlib.import_module(target)
    use = importlib.import_module(consumer)
    original = tgt.scale
    manager.apply("feat", [replace(f"{target}:scale", tripled, expect=SCALE)])
    assert tgt.scale is tripled and use.scale is tripled and use.use(2) == 6
    manager.revert("feat")
    assert tgt.scale is original and use.scale is original and use.use(2) == 4


def test_patch_before_import_applies_when_module_loads(modules):
    manager, target, consumer = modules
    manager.apply("feat", [replace(f"{target}:scale", tripled, expect=SCALE)])
    assert manager.report()[0]["state"] == "pending import"
    use = importlib.import_module(consumer)
    assert sys.modules[target].scale is tripled and use.use(2) == 6
    assert manager.report()[0]["state"] == "applied"
    manager.revert()
    assert use.use(2) == 4 and sys.modules[target].scale(2) == 4


def test_wraps_stack_in_apply_order_on_top_of_the_replacement(modules):
    manager, target, _ = modules
    tgt = importlib.import_module(target)
    manager.apply("a", [wrap(f"{target}:scale", add_one, expect=SCALE)])
    manager.apply("b", [wrap(f"{target}:scale", times_ten, expect=SCALE)])
    assert tgt.scale(1) == (1 * 2 + 1) * 10
    manager.apply("c", [replace(f"{target}:scale", tripled, expect=SCALE)])
    assert tgt.scale(1) == (1 * 3 + 1) * 10
    manager.revert("a")
    assert tgt.scale(1) == 1 * 3 * 10
    manager.revert("c")
    assert tgt.scale(1) == 1 * 2 * 10


def test_two_replacements_of_one_target_name_both_features(modules):
    manager, target, _ = modules
    importlib.import_module(target)
    manager.apply("first", [replace(f"{target}:scale", tripled, expect=SCALE)])
    with pytest.raises(PatchError, match=r"'first'.*'second'.*both replace"):
        manager.apply("second", [replace(f"{target}:scale", lambda x, factor=2: x, expect=SCALE)])


def test_signature_drift_fails_with_expected_found_and_version(modules):
    manager, target, _ = modules
    importlib.import_module(target)
    with pytest.raises(PatchError) as error:
        manager.apply("feat", [replace(f"{target}:scale", tripled, expect="(x)", name="scale-patch")])
    message = str(error.value)
    for needle in ("scale-patch", "'feat'", f"{target}:scale", "expected signature (x)",
                   "found signature (x, factor=2)", "megatron-core"):
        assert needle in message
    assert manager.report() == []


def test_signature_drift_on_a_later_import_fails_that_import(modules):
    manager, target, _ = modules
    manager.apply("feat", [replace(f"{target}:scale", tripled, expect="(x, y)")])
    with pytest.raises(PatchError, match="expected signature"):
        importlib.import_module(target)


def test_missing_target_fails_loudly(modules):
    manager, target, _ = modules
    importlib.import_module(target)
    with pytest.raises(PatchError, match="missing"):
        manager.apply("feat", [replace(f"{target}:gone", tripled, expect=SCALE)])
    with pytest.raises(PatchError, match="missing"):
        manager.apply("feat", [replace(f"{target}:Nope.forward", tripled, expect="(self, x)")])


def test_applying_twice_is_applying_once(modules):
    manager, target, _ = modules
    tgt = importlib.import_module(target)
    patch = wrap(f"{target}:scale", add_one, expect=SCALE)
    manager.apply("feat", [patch])
    manager.apply("feat", [patch])
    assert tgt.scale(1) == 3 and len(manager.report()) == 1


def test_class_methods_inherited_attributes_and_constants(modules):
    manager, target, _ = modules
    tgt = importlib.import_module(target)
    manager.apply("feat", [
        replace(f"{target}:Layer.forward", lambda self, x: x - 1, expect="(self, x)"),
        replace(f"{target}:Child.forward", lambda self, x: x * 5, expect="(self, x)"),
        replace(f"{target}:LIMIT", 7, expect=EXISTS),
    ])
    assert tgt.Layer().forward(3) == 2 and tgt.Child().forward(3) == 15 and tgt.LIMIT == 7
    manager.revert()
    assert "forward" not in vars(tgt.Child)
    assert tgt.Child().forward(3) == 4 and tgt.LIMIT == 3


def test_report_lists_feature_kind_target_and_copies(modules):
    manager, target, consumer = modules
    importlib.import_module(consumer)
    manager.apply("feat", [wrap(f"{target}:scale", add_one, expect=SCALE, name="add one")])
    line = inspect.currentframe().f_lineno - 1
    (row,) = manager.report()
    assert row == {"feature": "feat", "kind": "wrap", "target": f"{target}:scale", "name": "add one",
                   "state": "applied", "swept_copies": 1, "megatron": "any",
                   "defined_at": f"tests/patching/test_manager.py:{line}"}
    assert f"{target}:scale" in manager.format_report()


def test_targets_must_name_their_module():
    with pytest.raises(ValueError, match="module:attribute"):
        replace("no_colon.scale", tripled, expect=SCALE)


def test_describe_signature_unwraps_static_methods():
    assert describe_signature(staticmethod(tripled)) == SCALE


def test_original_is_kept_for_callers_that_need_it(modules):
    manager, target, _ = modules
    tgt = importlib.import_module(target)
    original = tgt.scale
    manager.apply("feat", [replace(f"{target}:scale", tripled, expect=SCALE)])
    assert manager.original(f"{target}:scale") is original
    with pytest.raises(KeyError):
        manager.original(f"{target}:LIMIT")


def test_two_managers_both_see_a_later_import(modules):
    manager, target, _ = modules
    other = PatchManager()
    try:
        other.apply("other", [wrap(f"{target}:scale", add_one, expect=SCALE)])
        manager.apply("feat", [wrap(f"{target}:LIMIT", lambda limit: limit + 1, expect=EXISTS)])
        tgt = importlib.import_module(target)
        assert tgt.scale(1) == 3 and tgt.LIMIT == 4
    finally:
        other.revert()


def test_signatures_compare_names_kinds_and_defaults_not_annotations():
    def annotated(x: "torch.Tensor", factor: int = 2) -> "torch.Tensor":
        return x

    def keyword_only(x, *, factor=2):
        return x

    assert describe_signature(annotated) == SCALE
    assert describe_signature(keyword_only) != SCALE
    assert describe_signature(lambda x, factor=3: x) != SCALE


def test_only_the_variant_for_the_installed_release_applies(modules):
    manager, target, _ = modules
    tgt = importlib.import_module(target)
    manager.apply("feat", [
        replace(f"{target}:scale", tripled, expect=SCALE, megatron=">=0.1,<0.2"),
        wrap(f"{target}:scale", add_one, expect=SCALE, megatron=">=0.2"),
    ])
    (row,) = manager.report()
    assert row["kind"] == "wrap" and row["megatron"] == ">=0.2.0"
    assert tgt.scale(1) == 3


def test_version_ranges():
    from ascendspeed.patching import VersionRange, release

    assert release("0.16") == (0, 16, 0) and release("0.19.2rc1") == (0, 19, 2)
    window = VersionRange.parse(">=0.15,<0.17")
    assert "0.15.0" in window and "0.16.1" in window and "0.17.0" not in window and "0.14.9" not in window
    with pytest.raises(ValueError, match="clauses"):
        VersionRange.parse("0.15")


def test_markdown_report_names_where_each_patch_is_defined(modules):
    manager, target, _ = modules
    importlib.import_module(target)
    manager.apply("feat", [replace(f"{target}:scale", tripled, expect=SCALE)])
    table = manager.format_report(markdown=True).splitlines()
    assert table[0].startswith("| feature | kind | target |")
    assert f"`{target}:scale`" in table[2] and "tests/patching/test_manager.py:" in table[2]


def test_a_feature_is_applied_all_or_nothing(modules):
    manager, target, _ = modules
    tgt = importlib.import_module(target)
    original = tgt.scale
    with pytest.raises(PatchError, match="expected signature"):
        manager.apply("feat", [
            replace(f"{target}:scale", tripled, expect=SCALE),
            replace(f"{target}:Layer.forward", lambda self, x: x, expect="(self, y)"),
        ])
    assert tgt.scale is original and manager.report() == []


def test_loaded_modules_are_swept_once_per_apply_and_never_on_revert(modules, monkeypatch):
    """A pass over every loaded module is the manager's one costly step (thousands of modules under
    Megatron): a batch of patches shares one pass, and reverting a feature only rewrites the copies the pass
    found. Reverting one feature used to re-sweep every other feature's targets, several seconds each."""
    manager, target, consumer = modules
    tgt = importlib.import_module(target)
    use = importlib.import_module(consumer)
    original_scale, original_forward = tgt.scale, tgt.Layer.forward
    passes = []
    sweep = PatchManager._sweep_loaded_modules

    def counted_sweep(self, records):
        if records:
            passes.append(len(records))
        sweep(self, records)

    monkeypatch.setattr(PatchManager, "_sweep_loaded_modules", counted_sweep)
    manager.apply("first", [replace(f"{target}:scale", tripled, expect=SCALE),
                            replace(f"{target}:Layer.forward", lambda self, x: x + 2, expect="(self, x)")])
    assert passes == [1], "one pass for the batch (only the module-level function has copies to sweep)"
    manager.apply("second", [wrap(f"{target}:scale", add_one, expect=SCALE)])
    assert passes == [1], "a target already patched has its copies on record"
    assert use.use(2) == 7 and use.scale is tgt.scale
    manager.revert("second")
    assert passes == [1] and use.use(2) == 6 and use.scale is tripled
    manager.revert("first")
    assert passes == [1]
    assert tgt.scale is original_scale and use.scale is original_scale and tgt.Layer.forward is original_forward
