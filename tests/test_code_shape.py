"""The rules the code base keeps (issue: a house the next builders can live in), checked on its source."""

import ast
import subprocess
from dataclasses import fields
from pathlib import Path

from sahajbert.arguments import PeerArguments

from .swarm_helpers import ROOT

PACKAGE = ROOT / "sahajbert"
MOST_PARAMETERS = 7  # past this, a function wants an argument object
# what only the adapter may touch: attributes of hivemind's objects that its API does not document
HIVEMIND_INTERNALS = {
    "state_averager",
    "tracker",
    "scheduled_grads",
    "scheduled_state",
    "pending_updates",
    "main_parameters",
    "_update_scheduler",
    "schedule_step",
    "set_group_bits",
    "sync_epoch_when_averaging",
    "state_sharing_priority",
}


def tracked_files(*patterns: str) -> list[Path]:
    listing = subprocess.run(["git", "ls-files", *patterns], cwd=ROOT, capture_output=True, text=True, check=True)
    return [ROOT / line for line in listing.stdout.splitlines() if (ROOT / line).exists()]


def package_modules() -> dict[str, ast.Module]:
    return {
        "sahajbert." + path.relative_to(PACKAGE).with_suffix("").as_posix().replace("/", "."): ast.parse(
            path.read_text()
        )
        for path in PACKAGE.rglob("*.py")
    }


def test_nothing_edits_sys_path_outside_the_tests():
    offenders = [
        str(path.relative_to(ROOT))
        for path in tracked_files("*.py", "*.ipynb")
        if not path.relative_to(ROOT).parts[0] == "tests" and "sys.path" in path.read_text()
    ]
    assert offenders == []


def test_no_module_level_import_circle_in_the_package():
    modules = package_modules()
    graph = {}
    for name, tree in modules.items():
        imported = set()
        for node in tree.body:  # module level only: an import inside a function runs later
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sahajbert"):
                imported.add(node.module)
                imported.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names if alias.name.startswith("sahajbert"))
        graph[name] = imported & modules.keys()

    def cycle_from(start, path):
        for nxt in graph[path[-1]]:
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, path + [nxt])
                if found:
                    return found
        return None

    cycles = [cycle for cycle in (cycle_from(name, [name]) for name in graph) if cycle]
    assert cycles == [], cycles[0] if cycles else None


def package_functions() -> list[tuple[str, list[ast.arg]]]:
    """Every function and method of the package as (module.function, its parameters but self and cls)."""
    found = []
    for name, tree in package_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                every = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
                found.append((f"{name}.{node.name}", [a for a in every if a.arg not in ("self", "cls")]))
    return found


def test_no_function_in_the_package_takes_more_than_seven_parameters():
    too_many = [f"{name}: {len(params)}" for name, params in package_functions() if len(params) > MOST_PARAMETERS]
    assert too_many == []


def test_every_argument_object_parameter_is_typed_with_its_class():
    untyped = [
        f"{name}({param.arg})"
        for name, params in package_functions()
        for param in params
        if param.arg.endswith("_args") and param.annotation is None
    ]
    assert untyped == []


def test_only_the_adapter_reaches_into_hivemind():
    offenders = []
    for name, tree in package_modules().items():
        if name == "sahajbert.hivemind_compat":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in HIVEMIND_INTERNALS:
                offenders.append(f"{name}: .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                ("hivemind.averaging", "hivemind.optim")
            ):
                offenders.append(f"{name}: from {node.module}")
    assert offenders == []


def test_peer_arguments_groups_are_its_fields():
    assert PeerArguments.GROUPS == tuple(f.type for f in fields(PeerArguments))
