"""docs/patching.md carries the table of every patch, generated from the code: it must be current."""
import os
import shutil

from ascendspeed import adaptor

DOC = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "patching.md")


def test_patch_table_in_the_docs_is_current(tmp_path):
    copy = tmp_path / "patching.md"
    shutil.copy(DOC, copy)
    changed = adaptor.write_patch_table(str(copy))
    assert not changed, (
        "docs/patching.md's patch table is stale: run "
        "`python -m ascendspeed.megatron_adaptor --write-table docs/patching.md`"
    )


def test_every_patch_names_its_definition_and_every_target_is_literal_in_it():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for row in adaptor.every_patch():
        path, line = row["defined_at"].rsplit(":", 1)
        with open(os.path.join(root, path), encoding="utf-8") as handle:
            source = handle.read()
        assert f'"{row["target"]}"' in source, f"{row['target']} is not written out in {path}"
