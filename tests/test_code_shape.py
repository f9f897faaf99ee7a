"""The rules the code base keeps (issue: a house the next builders can live in), checked on its source."""

import ast
import subprocess
from dataclasses import fields
from pathlib import Path

from sahajbert.flags import PeerArguments

from .swarm_helpers import ROOT

PACKAGE = ROOT / "sahajbert"
MOST_PARAMETERS = 7  # past this, a function wants an argument object
FENCE = "sahajbert.hivemind_ext"  # the one package that may use hivemind beyond its documented API
# What code outside the fence may import from hivemind: its documented API. An import or an attribute chain
# `hivemind.x.y` is allowed if it is one of these names or lies under one of these modules.
HIVEMIND_API = {
    "hivemind",  # `import hivemind`, for the names below
    "hivemind.DHT",
    "hivemind.Optimizer",
    "hivemind.GradScaler",
    "hivemind.get_dht_time",
    "hivemind.utils.get_dht_time",
    "hivemind.utils.timed_storage.get_dht_time",  # where hivemind defines it (`hivemind.get_dht_time` re-exports it)
    "hivemind.compression",  # the codecs a DHT user passes to Optimizer (grad_compression, ...), a documented module
    "hivemind.dht.schema",  # record schemas (SchemaValidator, BytesWithPublicKey): the DHT's documented validators
    "hivemind.dht.crypto",  # RSASignatureValidator, likewise
    "hivemind.p2p.PeerID",  # the peer ids the DHT and the optimizer report
    # the p2p daemon client hivemind exports from hivemind.p2p: a short-lived daemon for invites (access.py) and
    # the streams of our own protocols, opened with its public call_binary_stream_handler
    "hivemind.p2p.P2P",
    # DHT(authorizer=...) takes a TokenAuthorizerBase, which signs with hivemind's RSA keys and AccessToken messages:
    # the extension point hivemind offers for invite-only DHTs
    "hivemind.utils.auth.TokenAuthorizerBase",
    "hivemind.proto.auth_pb2.AccessToken",
    "hivemind.utils.crypto.RSAPrivateKey",
    "hivemind.utils.crypto.RSAPublicKey",
    "hivemind.utils.multiaddr.Multiaddr",  # the multiaddr package's class, which DHT(initial_peers=...) takes
}
# attributes of hivemind's objects that its API does not document: only the fence reads or sets them
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
    "add_binary_stream_handler",  # our protocols are served through hivemind_ext.p2p.add_stream_handler
    "receive_raw_data",
    "_make_process_args",
    "_BASE_COMPRESSION_TYPES",
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


def hivemind_names(tree: ast.Module) -> set[str]:
    """The hivemind names a module uses: what it imports from hivemind, and each attribute chain `hivemind.x.y`."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "hivemind":
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names if alias.name.split(".")[0] == "hivemind")
        elif isinstance(node, ast.Attribute) and not isinstance(getattr(node, "parent", None), ast.Attribute):
            chain, inner = [], node
            while isinstance(inner, ast.Attribute):
                chain.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "hivemind":
                names.add(".".join(["hivemind", *reversed(chain)]))
    return names


def allowed(name: str) -> bool:
    return any(name == api or name.startswith(api + ".") and api != "hivemind" for api in HIVEMIND_API)


def modules_outside_the_fence() -> dict[str, ast.Module]:
    """Every tracked Python file but the tests' and the fence's: the package, the scripts, the benchmarks."""
    found = {}
    for path in tracked_files("*.py"):
        relative = path.relative_to(ROOT)
        name = relative.with_suffix("").as_posix().replace("/", ".")
        if relative.parts[0] == "tests" or name == FENCE or name.startswith(FENCE + "."):
            continue
        tree = ast.parse(path.read_text())
        for parent in ast.walk(tree):  # attribute chains are read from their outermost attribute
            for child in ast.iter_child_nodes(parent):
                child.parent = parent
        found[name] = tree
    return found


def test_outside_the_fence_only_hivemind_s_documented_api_is_used():
    offenders = []
    for name, tree in modules_outside_the_fence().items():
        offenders += [f"{name}: {used}" for used in sorted(hivemind_names(tree)) if not allowed(used)]
        offenders += [
            f"{name}: .{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr in HIVEMIND_INTERNALS
        ]
    assert offenders == []


def test_the_allowlist_catches_an_import_or_a_chain_beyond_the_api():
    tree = ast.parse(
        "import hivemind\nfrom hivemind.averaging.matchmaking import Matchmaking\nfrom hivemind import DHT\n"
        "x = hivemind.optim.progress_tracker.ProgressTracker\ny = hivemind.compression.NoCompression()\n"
    )
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent
    refused = sorted(used for used in hivemind_names(tree) if not allowed(used))
    assert refused == ["hivemind.averaging.matchmaking.Matchmaking", "hivemind.optim.progress_tracker.ProgressTracker"]


def test_the_fence_imports_nothing_else_of_the_project():
    offenders = [
        f"{name}: {node.module}"
        for name, tree in package_modules().items()
        if name == FENCE or name.startswith(FENCE + ".")
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("sahajbert")
        and not (node.module == FENCE or node.module.startswith(FENCE + "."))
    ] + [
        f"{name}: {alias.name}"
        for name, tree in package_modules().items()
        if name == FENCE or name.startswith(FENCE + ".")
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
        if alias.name.startswith("sahajbert") and not alias.name.startswith(FENCE + ".")
    ]
    assert offenders == []


def test_importing_the_fence_replaces_nothing_in_hivemind():
    """Module-level code of the fence assigns into no other module (`x.y = ...`, `x[k] = ...`, `setattr(...)`):
    the replacements happen in `install()` alone (`patches.apply`)."""
    offenders = []
    for name, tree in package_modules().items():
        if not name.startswith(FENCE):
            continue
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(target, ast.Attribute | ast.Subscript) for target in targets):
                offenders.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
                called = node.value.func
                if isinstance(called, ast.Name) and called.id == "setattr":
                    offenders.append(f"{name}:{node.lineno}")
    assert offenders == []


MOST_LINES = 600  # per module of the package
# the peer loop (construction, run, a pass, a step, after a global step), read top to bottom in one file; joining,
# ending, rollback and reports are parts of their own
MOST_TRAINER_LINES = 350


def test_no_module_of_the_package_is_over_600_lines():
    long = {
        str(path.relative_to(ROOT))
        for path in PACKAGE.rglob("*.py")
        if len(path.read_text().splitlines()) > MOST_LINES
    }
    assert not long, long


def test_the_trainer_s_loop_fits_in_350_lines():
    assert len((PACKAGE / "trainer.py").read_text().splitlines()) <= MOST_TRAINER_LINES


def test_peer_arguments_groups_are_its_fields():
    assert PeerArguments.GROUPS == tuple(f.type for f in fields(PeerArguments))


def names_in(node: ast.AST) -> list[str]:
    """The names and attribute names an expression mentions."""
    leaves = [leaf for leaf in ast.walk(node) if isinstance(leaf, ast.Name | ast.Attribute)]
    return [leaf.id if isinstance(leaf, ast.Name) else leaf.attr for leaf in leaves]


def test_no_code_asks_which_optimizer_it_runs():
    """A mode of training is a class that answers the loop's questions (GuardedOptimizer's, overridden by
    DiLoCoOptimizer), never a test of the optimizer's class."""
    offenders = [
        f"{name}:{node.lineno}"
        for name, tree in package_modules().items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "isinstance"
        and len(node.args) == 2
        and any(class_name.endswith("Optimizer") for class_name in names_in(node.args[1]))
    ]
    assert offenders == []
