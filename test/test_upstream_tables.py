"""No patch moves an entry of an ordered upstream table.

Upstream's ordered literals (``POSITIONAL_FIELD_ORDER`` in ``arg_groups/field_order.py``, whose
comment says to append, and any other module- or class-level tuple or list of constants in a file
the series edits) fix positions that callers rely on: ``ServerArgs``'s positional constructor, a
choices list's order in ``--help``. With the series applied, every upstream entry of such a table
keeps its index: the fork may only append after upstream's last entry (or, as every patch does
for its server arguments, leave the table alone: ``collect_input_fields`` appends unlisted fields
after it).
"""

from __future__ import annotations

import ast

from forklib.git import out


def ordered_tables(source: str) -> dict[str, list]:
    """Module- and class-level ``NAME = (...)`` / ``[...]`` of constants, by qualified name."""
    tables: dict[str, list] = {}

    def visit(body, prefix):
        for node in body:
            if isinstance(node, ast.ClassDef):
                visit(node.body, f"{prefix}{node.name}.")
                continue
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target, value = node.targets[0], node.value
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                target, value = node.target, node.value
            else:
                continue
            if not isinstance(target, ast.Name) or not isinstance(
                value, (ast.Tuple, ast.List)
            ):
                continue
            if value.elts and all(isinstance(e, ast.Constant) for e in value.elts):
                tables[prefix + target.id] = [e.value for e in value.elts]

    visit(ast.parse(source).body, "")
    return tables


def moved_entries(upstream: str, patched: str) -> list[str]:
    """Each upstream table entry whose index the patched source changes, or a table it removes."""
    problems = []
    after = ordered_tables(patched)
    for name, entries in ordered_tables(upstream).items():
        if name not in after:
            problems.append(f"{name}: removed or no longer a literal")
            continue
        new = after[name]
        for i, entry in enumerate(entries):
            if i >= len(new) or new[i] != entry:
                where = new.index(entry) if entry in new else None
                problems.append(
                    f"{name}[{i}] = {entry!r} is "
                    + (f"at index {where} now" if where is not None else "gone")
                    + " (append after upstream's last entry instead)"
                )
                break  # the first moved entry names the hunk
    return problems


def test_no_patch_moves_an_upstream_table_entry(assembled, series):
    problems = {}
    for path in sorted({f for p in series for f in p.files if f.endswith(".py")}):
        upstream = out(assembled.tree, "show", f"{assembled.base}:{path}")
        patched = (assembled.tree / path).read_text()
        if found := moved_entries(upstream, patched):
            problems[path] = found
    assert problems == {}


def test_positional_field_order_is_upstreams_then_appended():
    """The engine's real constructor order starts with upstream's tuple, entry for entry."""
    from sglang.srt.arg_groups.field_order import POSITIONAL_FIELD_ORDER
    from sglang.srt.server_args import ServerArgs

    fields = list(ServerArgs.__struct_fields__)
    known = [n for n in POSITIONAL_FIELD_ORDER if n in fields]
    assert fields[: len(known)] == known
    assert "weight_loader_fast_load" in fields[len(known) :]


UPSTREAM_SRC = """
POSITIONAL_FIELD_ORDER = (
    "model_path",
    "weight_loader_drop_cache_after_load",
    "remote_instance_weight_loader_seed_instance_ip",
)
class Choices:
    ORDER = ["a", "b"]
"""


def test_an_insertion_in_the_middle_is_found():
    inserted = UPSTREAM_SRC.replace(
        '"weight_loader_drop_cache_after_load",\n',
        '"weight_loader_drop_cache_after_load",\n    "weight_loader_fast_load",\n',
    )
    (problem,) = moved_entries(UPSTREAM_SRC, inserted)
    assert "POSITIONAL_FIELD_ORDER[2]" in problem and "at index 3 now" in problem
    reordered = UPSTREAM_SRC.replace('["a", "b"]', '["b", "a"]')
    assert moved_entries(UPSTREAM_SRC, reordered) == [
        "Choices.ORDER[0] = 'a' is at index 1 now (append after upstream's last entry instead)"
    ]
    removed = UPSTREAM_SRC.replace('    ORDER = ["a", "b"]\n', "    pass\n")
    assert moved_entries(UPSTREAM_SRC, removed) == [
        "Choices.ORDER: removed or no longer a literal"
    ]


def test_appending_is_allowed():
    appended = UPSTREAM_SRC.replace(
        '"remote_instance_weight_loader_seed_instance_ip",\n',
        '"remote_instance_weight_loader_seed_instance_ip",\n    "weight_loader_fast_load",\n',
    ).replace('["a", "b"]', '["a", "b", "c"]')
    assert moved_entries(UPSTREAM_SRC, appended) == []
