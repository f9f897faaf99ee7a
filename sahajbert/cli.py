"""Command-line plumbing shared by every script: argument parsing, logging, and errors meant for people.

Every script's flags come from the argument dataclasses (`sahajbert.flags`), one help group per dataclass. The
parser is plain argparse, built here so that the rules hold everywhere: a flag is spelled out in full (a prefix is
refused, with a suggestion), a bad value is one `error:` line, a settings `.json` file combines with flags (flags
win), and each script shows only the flags it uses.
"""

import argparse
import asyncio
import concurrent.futures
import dataclasses
import difflib
import enum
import json
import logging
import multiprocessing
import os
import re
import sys
import threading
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

logger = logging.getLogger("sahajbert")


class UserError(Exception):
    """A mistake in the input that a person can fix; reported as one line, never as a traceback."""


class _DropPendingTaskNoise(logging.Filter):
    """asyncio's "Task was destroyed but it is pending!" at shutdown: hivemind's loops end with tasks in flight; and
    its "Task exception was never retrieved" for hivemind's averager finishing a round this peer had cancelled (it
    sets the result of a cancelled step: InvalidStateError), which changes nothing."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Task was destroyed but it is pending"):
            return False
        error = record.exc_info[1] if record.exc_info else None
        late_result = isinstance(error, concurrent.futures.InvalidStateError | asyncio.InvalidStateError)
        if str(record.msg).startswith("Unhandled exception in client_connected_cb") and error is not None:
            # a stream that hivemind's p2p daemon client failed to dispatch (plain hivemind peers log it too): its
            # all-reduce part or request is then missing, which the round handles and reports; one line, not an error
            record.levelno, record.levelname = logging.INFO, "INFO"
            record.msg, record.args, record.exc_info, record.exc_text = (
                f"hivemind's p2p client dropped an incoming stream ({type(error).__name__}: {error})",
                (),
                None,
                None,
            )
            return True
        return not (late_result and "CANCELLED" in str(error))


def setup_logging(level: int = logging.INFO) -> None:
    """One log format for every script: stable, greppable lines on stderr, one line per event."""
    logging.basicConfig(
        level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", force=True
    )
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "fsspec", "huggingface_hub"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # forked children (hivemind's DHT and averager processes) inherit this logging setup
    logging.getLogger("asyncio").addFilter(_DropPendingTaskNoise())
    # no progress bars ("Writing model shards" would interleave with progress lines): transformers reads this when it
    # is imported, and a script's --help imports it not at all
    os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    if "transformers" in sys.modules:
        from transformers.utils import logging as transformers_logging

        transformers_logging.disable_progress_bar()


# ---- parsing ----

METAVARS = {int: "N", float: "NUM", str: "TEXT"}
_TRUE, _FALSE = {"true", "yes", "1", "on", "y", "t"}, {"false", "no", "0", "off", "n", "f"}
_NOT_A_VALUE = object()


def _to_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got '{text}'")


def _bool_type():
    _to_bool.__name__ = "true/false"  # argparse names the type in "invalid ... value"
    return _to_bool


def _json_value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class _ShortUsage(argparse.HelpFormatter):
    """Help without the full usage wall: the usage line names the script and says where the flags are."""

    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=36, width=119)

    def _format_usage(self, usage, actions, groups, prefix) -> str:
        return f"usage: {self._prog} [SETTINGS.json] [--flag value ...]\n\n"


class Parser(argparse.ArgumentParser):
    """argparse that raises UserError instead of printing its usage and exiting (one `error:` line)."""

    def error(self, message: str):
        match = re.match(r"argument (--\w+)", message)
        action = self.actions_by_flag.get(match.group(1)) if match else None
        if action is not None:
            message += f" (usage: {flag_usage(action)})"
        raise UserError(message)

    @property
    def actions_by_flag(self) -> dict[str, argparse.Action]:
        return {flag: action for action in self._actions for flag in action.option_strings}


def flag_usage(action: argparse.Action) -> str:
    metavar = action.metavar or action.dest.upper()
    if action.nargs == 0:
        return action.option_strings[0]
    if action.nargs == "?":
        return f"{action.option_strings[0]} [{metavar}]"
    if action.nargs == "+":
        return f"{action.option_strings[0]} {metavar} [{metavar} ...]"
    return f"{action.option_strings[0]} {metavar}"


def _field_kind(annotation) -> tuple[type | None, bool, Sequence | None]:
    """(scalar type for argparse, is a list, choices) of a field's annotation; None type: take the text as is."""
    origin = typing.get_origin(annotation)
    if origin is typing.Union or isinstance(annotation, types.UnionType):
        options = [a for a in typing.get_args(annotation) if a is not type(None)]
        if str in options:
            return str, False, None  # transformers' "str or its enum" fields, and the like
        if len(options) == 1:
            return _field_kind(options[0])
        return None, False, None
    if origin is typing.Literal:
        return str, False, [str(a) for a in typing.get_args(annotation)]
    if origin in (list, tuple, Sequence):
        (item, *_) = typing.get_args(annotation) or (str,)
        scalar, _, choices = _field_kind(item)
        return scalar, True, choices
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return str, False, [str(member.value) for member in annotation]
    if annotation in (dict, Mapping) or origin in (dict, Mapping):
        return _json_value, False, None
    if annotation in (str, int, float, bool):
        return annotation, False, None
    return str, False, None


def _field_default(field: dataclasses.Field):
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _NOT_A_VALUE


def _describe_default(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple)):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


@dataclasses.dataclass(frozen=True)
class Flags:
    """What one script takes: its argument groups and how it differs from their plain definitions.

    `skip`: fields the script does not use (no flag; the dataclass default stands). `hidden`: accepted but not shown
    (a class with HIDE_INHERITED also hides the fields of its library base class, but its SHOWN_INHERITED).
    `defaults`: this script's own defaults (the aux peer writes to outputs/aux, not outputs/trainer).
    `expansions`: fields whose value stands for other fields' values ({"recipe": {"sahajbert": {...}}}); those
    values come under a settings file's and under the flags given, which win.
    """

    groups: Sequence[type]
    description: str = ""
    skip: frozenset[str] = frozenset()
    hidden: frozenset[str] = frozenset()
    defaults: Mapping[str, object] = dataclasses.field(default_factory=dict)
    expansions: Mapping[str, Mapping[str, Mapping[str, object]]] = dataclasses.field(default_factory=dict)

    @property
    def classes(self) -> list[type]:
        return [group for t in self.groups for group in getattr(t, "GROUPS", (t,))]

    def fields(self) -> list[tuple[type, dataclasses.Field]]:
        found = []
        for cls in self.classes:
            hints = typing.get_type_hints(cls)
            for field in dataclasses.fields(cls):
                if field.init and field.name not in self.skip:
                    field.type = hints[field.name]
                    found.append((cls, field))
        return found

    def is_hidden(self, cls: type, field: dataclasses.Field) -> bool:
        if field.name in self.hidden:
            return True
        own = field.name in cls.__dict__.get("__annotations__", {})
        shown = own or field.name in getattr(cls, "SHOWN_INHERITED", ())
        return getattr(cls, "HIDE_INHERITED", False) and not shown

    def build(self, prog: str | None = None, settings: Mapping[str, object] | None = None) -> Parser:
        """The argparse parser, with `settings` (from a .json file) as defaults that flags override."""
        settings = settings or {}
        parser = Parser(
            prog=prog, description=self.description, allow_abbrev=False, formatter_class=_ShortUsage, add_help=False
        )
        parser.add_argument("-h", "--help", action="help", help="Show this help and exit.")
        groups: dict[type, argparse._ArgumentGroup] = {}
        for cls, field in self.fields():
            if cls not in groups:
                title = getattr(cls, "TITLE", cls.__name__)
                doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else None
                groups[cls] = parser.add_argument_group(title, doc)
            self._add(groups[cls], cls, field, settings)
        return parser

    def _add(self, group, cls: type, field: dataclasses.Field, settings: Mapping[str, object]) -> None:
        scalar, is_list, choices = _field_kind(field.type)
        choices = field.metadata.get("choices", choices)
        default = settings.get(field.name, self.defaults.get(field.name, _field_default(field)))
        required = default is _NOT_A_VALUE
        hidden = self.is_hidden(cls, field)
        text = field.metadata.get("help", "")
        if required:
            text += " (required)"
        elif default is not None and not (is_list and not default) and text:
            text += f" (default: {_describe_default(default)})"
        kwargs: dict = {"dest": field.name, "help": argparse.SUPPRESS if hidden else text}
        if required:
            kwargs["required"] = True
        else:
            kwargs["default"] = default
        if choices is not None:
            kwargs["choices"] = list(choices)
            kwargs["metavar"] = "{" + ",".join(map(str, choices)) + "}"
        if scalar is bool:
            kwargs.update(nargs="?", const=True, type=_bool_type(), metavar="true|false")
        elif scalar is not None:
            kwargs.update(type=scalar)
            kwargs.setdefault("metavar", METAVARS.get(scalar, "VALUE"))
        if is_list:
            kwargs["nargs"] = "+"
        group.add_argument(f"--{field.name}", **kwargs)
        if scalar is bool and default is True:
            group.add_argument(
                f"--no_{field.name}",
                dest=field.name,
                action="store_false",
                help=argparse.SUPPRESS if hidden else field.metadata.get("negative_help", f"Turn --{field.name} off."),
            )

    def option_names(self) -> list[str]:
        names = [f"--{field.name}" for _, field in self.fields()]
        return names + [f"--no_{f.name}" for _, f in self.fields() if _field_default(f) is True]

    def suggestion(self, flag: str) -> str:
        """The did-you-mean hint for a flag that is not one of this script's."""
        flag = flag.split("=", 1)[0]
        names = self.option_names()
        matches = [name for name in names if name.startswith(flag)]  # a shortened flag: say what it is short for
        matches += difflib.get_close_matches(flag, names, n=3, cutoff=0.7)
        matches = list(dict.fromkeys(matches))[:3]
        return f" (did you mean {' or '.join(matches)}?)" if matches else ""


def _read_settings(path: str, flags: Flags) -> dict:
    """A settings .json file: exact field names only (a prefix or a typo is refused with a suggestion)."""
    file = Path(path)
    if file.is_dir():
        raise UserError(f"settings file '{path}' is a directory: give a .json file of flag names and values")
    if not file.is_file():
        raise UserError(f"settings file not found: '{path}'")
    try:
        settings = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        where = f" (line {e.lineno})" if isinstance(e, json.JSONDecodeError) else ""
        raise UserError(f"settings file '{path}' is not valid JSON{where}: {e}") from e
    if not isinstance(settings, dict):
        raise UserError(f"settings file '{path}' must hold one JSON object of flag names and values")
    known = {field.name for _, field in flags.fields()}
    for key in settings:
        if key not in known:
            raise UserError(f"settings file '{path}': unknown setting '{key}'{flags.suggestion('--' + key)}")
    return settings


def _expanded(flags: Flags, argv: Sequence[str], settings: Mapping[str, object]) -> dict:
    """The field values that the chosen recipe or protocol (a flag, else the settings file) stands for."""
    values: dict = {}
    for name, choices in flags.expansions.items():
        chosen = settings.get(name)
        for index, item in enumerate(argv):  # the last one given wins, as for any flag
            if item == f"--{name}" and index + 1 < len(argv):
                chosen = argv[index + 1]
            elif item.startswith(f"--{name}="):
                chosen = item.split("=", 1)[1]
        values.update(choices.get(chosen, {}))  # an unknown choice is left to argparse, which names the choices
    return values


def normalize_flag_spelling(argv: Sequence[str]) -> list[str]:
    """`--max-steps` is read as `--max_steps` (transformers' examples accept both spellings)."""
    out = []
    for item in argv:
        match = re.fullmatch(r"--([A-Za-z][\w-]*)(=.*)?", item, flags=re.DOTALL)  # a flag, not a value such as "--a b"
        out.append(f"--{match.group(1).replace('-', '_')}{match.group(2) or ''}" if match else item)
    return out


def parse_args(
    dataclass_types: Sequence[type] | Flags, argv: Sequence[str] | None = None, prog: str | None = None
) -> tuple:
    """Parse flags (after an optional settings `.json` file, which they override) into the argument dataclasses.

    A composite such as `PeerArguments` stands for its GROUPS: their flags are parsed, and it is built from them.
    Every mistake, including a dataclass's own validation, becomes one UserError line.
    """
    flags = dataclass_types if isinstance(dataclass_types, Flags) else Flags(tuple(dataclass_types))
    argv = normalize_flag_spelling(sys.argv[1:] if argv is None else argv)
    settings = {}
    if argv and argv[0].endswith(".json") and not argv[0].startswith("-"):
        settings, argv = _read_settings(argv[0], flags), argv[1:]
    parser = flags.build(prog, {**_expanded(flags, argv, settings), **settings})
    namespace, rest = parser.parse_known_args(argv)
    if rest:
        unknown = rest[0]
        if unknown.startswith("-"):
            raise UserError(f"unknown flag {unknown.split('=', 1)[0]}{flags.suggestion(unknown)}; --help lists them")
        raise UserError(f"unexpected value '{unknown}': every value follows its flag, e.g. --max_steps 10")
    values = vars(namespace)
    built = {}
    for cls in flags.classes:
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        try:
            built[cls] = cls(**{name: value for name, value in values.items() if name in names})
        except (ValueError, TypeError) as e:
            raise UserError(str(e).strip().splitlines()[0]) from e
    try:  # a composite's own validation: settings of two groups that do not go together
        return tuple(
            t(*(built[group] for group in t.GROUPS)) if hasattr(t, "GROUPS") else built[t] for t in flags.groups
        )
    except (ValueError, TypeError) as e:
        raise UserError(str(e).strip().splitlines()[0]) from e


def help_text(flags: Flags, prog: str) -> str:
    return flags.build(prog).format_help()


def _drop_closed_loop_finalizers(unraisable) -> None:
    """sys.unraisablehook without hivemind's MPFuture finalizers that find their event loop closed.

    A future garbage-collected after its averager's loop ended (at exit, after the last line a person should read)
    wakes its waiters on that closed loop; the RuntimeError says nothing about the run. Every other unraisable
    exception is printed as Python prints it.
    """
    finalizer = getattr(unraisable.object, "__qualname__", "")
    if finalizer == "MPFuture.__del__" and "Event loop is closed" in str(unraisable.exc_value):
        return
    sys.__unraisablehook__(unraisable)


# seconds a script has to exit once its main() has ended: Python joins the threads and child processes left
# (hivemind's processes are joined without a time limit), and a child stuck in its shutdown would keep a stopped peer
# alive for good. Past this the children left are killed and the script exits at once, with the same exit code.
EXIT_GRACE = 10.0


def _exit_within(code: int, seconds: float) -> None:
    def leave_now() -> None:
        try:
            left = multiprocessing.active_children()
            logger.warning(
                f"still exiting {seconds:.0f} s after the end: stopping {len(left)} process(es) left and leaving now"
            )
            for child in left:
                child.kill()
        except Exception:  # Python's own exit handler may be changing the list of children right now
            pass
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(seconds, leave_now)
    timer.daemon = True  # it runs while Python joins what is left, and never delays an exit itself
    timer.start()


def run(main: Callable[[], int | None]) -> None:
    """Run a script's main(); a UserError or Ctrl+C ends it with one clear line and a non-zero exit code. The script
    exits within EXIT_GRACE seconds of main()'s end, whatever it left running."""
    sys.unraisablehook = _drop_closed_loop_finalizers
    try:
        code = main() or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
        code = 130
    if getattr(main, "__module__", None) == "__main__":  # a script's process ends here; a caller's (a test's) goes on
        _exit_within(code, EXIT_GRACE)
    sys.exit(code)
