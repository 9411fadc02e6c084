"""Config plumbing shared by every command: strict sections, YAML, dotted overrides.

A command's config is a tree of :class:`Section` objects. Unknown keys, wrong types and
out-of-range values are rejected when the tree is built, with the dotted path of the
field and what it allows, before any work starts.
"""

from __future__ import annotations

import copy
import re
import types
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

T = TypeVar("T", bound="Section")


class ConfigError(ValueError):
    """A config that cannot be used; the message names the field path and what is allowed."""


class Section(BaseModel):
    """Base of every config section: unknown keys fail, assignments are validated, numbers are finite.

    No field means anything by NaN or infinity: limits that can be switched off take None.
    """

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(), allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        """true/false where a number belongs is refused: pydantic would read them as 1 and 0
        (``--model.lora.rank true`` trained rank 1)."""
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _takes_a_number_not_a_bool(field.annotation):
            raise ValueError("expected a number, not a boolean")
        return value

    @model_validator(mode="before")
    @classmethod
    def _keep_a_default_sections_own_values(cls, data: Any) -> Any:
        """A section whose default sets some of its fields (RL's ``optim``, ``lr=1e-6``) keeps them when a
        file or the command line gives only its other fields: they are merged under what is given."""
        if not isinstance(data, dict):
            return data
        for name, field in cls.model_fields.items():
            if field.default_factory is None or not isinstance(data.get(name), dict):
                continue
            default = field.get_default(call_default_factory=True)
            if isinstance(default, BaseModel) and default.model_fields_set:
                data = {**data, name: deep_merge(default.model_dump(exclude_unset=True), data[name])}
        return data

    def set_away_from_default(self, fields: Iterable[str]) -> list[str]:
        """Those of ``fields`` given a value other than their default, in order. A dumped config lists
        every field, so a field merely present at its default does not count as set."""
        defaults = type(self).model_fields
        return [
            f
            for f in fields
            if f in self.model_fields_set and getattr(self, f) != defaults[f].get_default(call_default_factory=True)
        ]


def _takes_a_number_not_a_bool(annotation: Any) -> bool:
    """Whether a field of this type takes an int or float (a Literal of numbers too) and no bool."""
    options = get_args(annotation) if get_origin(annotation) in (Union, types.UnionType) else (annotation,)
    numbers = bools = False
    for option in options:
        if get_origin(option) is Literal:
            values = get_args(option)
            bools = bools or any(isinstance(v, bool) for v in values)
            numbers = numbers or any(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
        elif get_origin(option) is Annotated:
            numbers = numbers or _takes_a_number_not_a_bool(get_args(option)[0])
        else:
            bools = bools or option is bool
            numbers = numbers or option in (int, float)
    return numbers and not bools


def _path_part(part: str | int) -> str:
    """A field name as written, quoted when it is empty or holds spaces or invisible characters."""
    text = str(part)
    plain = text and text.isprintable() and not any(c.isspace() for c in text)
    return text if plain else repr(text)


def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config ({source}):"]
    for item in err.errors():
        path = ".".join(_path_part(p) for p in item["loc"]) or "<root>"
        kind = item["type"]
        if kind == "extra_forbidden":
            lines.append(f"  {path}: unknown field (check the spelling; see --help for the fields)")
            continue
        if kind == "invalid_key":  # the location ends with the key itself, where a bool shows as 0 or 1
            key = item["input"]
            path = ".".join([_path_part(p) for p in item["loc"][:-1]] + [_path_part(str(key))])
            lines.append(f"  {path}: a field name must be text, not {type(key).__name__} {key!r} (quote it in YAML)")
            continue
        allowed = ""
        ctx = item.get("ctx") or {}
        if "expected" in ctx:
            allowed = f"; allowed: {ctx['expected']}"
        got = item.get("input")
        got_text = "" if isinstance(got, dict) else f" (got {got!r})"
        lines.append(f"  {path}: {item['msg']}{got_text}{allowed}")
    return "\n".join(lines)


def parse_config(cls: type[T], data: dict[str, Any], source: str = "config") -> T:
    """Build ``cls`` from plain data, turning pydantic's errors into one readable ConfigError."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source)) from None


class _DuplicateKeyError(Exception):
    """A mapping in a YAML file that holds the same key twice."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key given twice in one mapping is refused: plain YAML
    keeps the last one, so a second ``train:`` section would silently replace the first."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            self._refuse_duplicate_keys(node)
        return super().construct_mapping(node, deep=deep)

    def _refuse_duplicate_keys(self, node: Any) -> None:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            # '<<' merges another mapping in, and keys written next to it rightly override that mapping's
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                raise _DuplicateKeyError(
                    f"the key {key_node.value!r} is given twice in one mapping, on lines {first_line[key]} and "
                    f"{line}; keep one of them"
                )
            first_line[key] = line


# YAML 1.1 (PyYAML) reads a number in exponent form without a dot, 1e-5 or 1e3, as text; YAML 1.2 and
# the command line (_parse_scalar) read a number. The file reads it as the command line does.
_UniqueKeyLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"), list("-+0123456789")
)


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text: {err}") from None
    except OSError as err:  # unreadable: permissions, an I/O error
        raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}
    except _DuplicateKeyError as err:
        raise ConfigError(f"config file {path}: {err}") from None
    except (yaml.YAMLError, ValueError) as err:  # ValueError: a value YAML cannot build, e.g. the date 2001-13-01
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is not usable YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def _parse_scalar(text: str) -> Any:
    """Read a command-line value the way YAML would ('1e-5' -> float, 'true' -> bool, '[a, b]' -> list)."""
    try:  # the file's reading (1e-5 a number, as in YAML 1.2); quoted, '1e-5' stays text
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, ValueError, RecursionError, _DuplicateKeyError):  # not YAML, or not buildable: text
        return text


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``data['a']['b']`` for ``dotted='a.b'``, creating intermediate mappings. A mapping given
    for a mapping already there is merged into it field by field, so ``--optim '{lr: 0.1}'`` keeps
    the other ``optim`` fields of the config file."""
    keys = dotted.split(".")
    if not all(keys):
        raise ConfigError(f"--{dotted}: an override names a field by its dotted path, e.g. --optim.lr")
    node = data
    for key in keys[:-1]:
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"--{dotted}: '{key}' is not a section")
        node = child
    last = keys[-1]
    if isinstance(value, dict) and isinstance(node.get(last), dict):
        value = deep_merge(node[last], value)
    node[last] = value


def overrides_from_argv(cls: type[BaseModel], argv: list[str]) -> dict[str, Any]:
    """Turn ``['--a.b', '1', '--c=x', '--flag']`` into ``{'a.b': 1, 'c': 'x', 'flag': True}``, each value
    read by the type of the field of ``cls`` it sets (:func:`_command_line_value`)."""
    return {key: _command_line_value(cls, key, text) for key, text in _split_overrides(argv).items()}


def _split_overrides(argv: list[str]) -> dict[str, str | None]:
    """Each ``--key value`` or ``--key=value`` as ``{key: value}``; a flag given alone as ``{key: None}``."""
    result: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument {arg!r}: overrides look like --section.field value")
        key = arg[2:]
        text: str | None
        if "=" in key:
            key, text = key.split("=", 1)
            i += 1
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            text = argv[i + 1]
            i += 2
        else:
            text = None
            i += 1
        result[key] = text
    return result


def _union_members(annotation: Any) -> tuple[Any, ...]:
    """The types a field accepts: the members of a union (``str | None`` -> str, NoneType), else the type itself."""
    if get_origin(annotation) is Annotated:
        return _union_members(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return tuple(member for arg in get_args(annotation) for member in _union_members(arg))
    return (annotation,)


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds (``ModelConfig`` for ``ModelConfig | None``), or None for a value field."""
    models = [m for m in _union_members(annotation) if isinstance(m, type) and issubclass(m, BaseModel)]
    return models[0] if len(models) == 1 else None


_NO_SUCH_FIELD = object()


def _field_annotation(cls: type[BaseModel], dotted: str) -> Any:
    """The type of the field at ``dotted``: ``Any`` for a key inside a free-form mapping field, and
    ``_NO_SUCH_FIELD`` where the path names no field (validation then names it as unknown)."""
    annotation: Any = cls
    for key in dotted.split("."):
        model = _section_model(annotation)
        if model is None:
            mapping = any(m is dict or get_origin(m) is dict for m in _union_members(annotation))
            return Any if mapping else _NO_SUCH_FIELD
        field = model.model_fields.get(key)
        if field is None:
            return _NO_SUCH_FIELD
        annotation = field.annotation
    return annotation


def _is_text_type(member: Any) -> bool:
    """str, a path, or a choice among words (a Literal of strings)."""
    if get_origin(member) is Literal:
        return all(isinstance(choice, str) for choice in get_args(member))
    return isinstance(member, type) and issubclass(member, (str, PurePath))


def _command_line_value(cls: type[BaseModel], dotted: str, text: str | None) -> Any:
    """The value for ``--dotted`` given as ``text`` (None: the flag alone), by the field's type.

    The text is read as YAML would read it ('1e-5' a number, '[a, b]' a list), except that a text
    field takes it exactly as typed, since YAML would drop what follows ' #' and turn 'Q: {input}'
    into a mapping or '2024' into a number; an optional one takes ``null`` as unset. A field that also
    takes other types reads the text as YAML unless that drops part of it. A flag alone means true,
    and only for a true/false field.
    """
    annotation = _field_annotation(cls, dotted)
    if annotation is _NO_SUCH_FIELD:  # validation names the unknown field
        return True if text is None else _parse_scalar(text)
    if text is None:
        return _bare_flag_value(dotted, annotation)
    members = _union_members(annotation)
    values = [m for m in members if m is not type(None)]
    if values and all(_is_text_type(m) for m in values):
        return None if text == "null" and type(None) in members else text
    read_as_yaml = _parse_scalar(text)
    if any(_is_text_type(m) for m in values) and _yaml_drops_text(text, read_as_yaml):
        return text
    return read_as_yaml


def _bare_flag_value(dotted: str, annotation: Any) -> bool:
    """True for a flag given alone, if the field takes true/false or is a key of a free-form mapping
    (``--agent.env_args.verbose``, as a switch of the user's own code reads); any other field needs a value."""
    if annotation is Any or bool in _union_members(annotation):
        return True
    takes = "a mapping of its fields" if _section_model(annotation) is not None else _type_text(annotation)
    raise ConfigError(
        f"--{dotted} is given without a value: give one ({dotted} takes {takes}), "
        f"as in --{dotted} VALUE; only a true/false field may be given alone, meaning true"
    )


def _yaml_drops_text(text: str, read_as_yaml: Any) -> bool:
    """Whether YAML read ``text`` as a shorter string, e.g. 'auto # for now' as 'auto' (a comment);
    quotes are YAML's way to mark text, so removing them drops nothing."""
    plain = text.strip()
    quoted = plain[:1] in ("'", '"')
    return isinstance(read_as_yaml, str) and not quoted and read_as_yaml != plain


def resolve_config(
    cls: type[T],
    yaml_path: str | Path | None = None,
    overrides: dict[str, Any] | None = None,
    base: dict[str, Any] | None = None,
) -> T:
    """Precedence, lowest first: schema defaults < ``base`` < YAML file < ``overrides`` (dotted keys:
    the command line's, from :func:`overrides_from_argv`). A schema may add its own layer above its
    defaults in a ``mode="before"`` validator, as RL presets do."""
    data: dict[str, Any] = copy.deepcopy(base or {})  # overrides below must not write into the caller's preset
    source = "defaults"
    if yaml_path is not None:
        data = deep_merge(data, load_yaml(yaml_path))
        source = str(yaml_path)
    for dotted, value in (overrides or {}).items():
        set_dotted(data, dotted, value)
    if overrides:
        source += " + command-line overrides"
    return parse_config(cls, data, source)


def deep_merge(into: dict[str, Any], other: dict[str, Any]) -> dict[str, Any]:
    """``into`` updated by ``other``, nested sections merged key by key (neither argument is changed)."""
    out = dict(into)
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def to_yaml(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_yaml(config: BaseModel, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(to_yaml(config))
    tmp.replace(path)


def registered(registry: str, builtin: tuple[str, ...], default: str, description: str) -> Any:
    """A field that names a function of the algorithm library (``registry`` is the name of a
    :mod:`raylign.algorithms.registry` registry): one of the ``builtin`` names, or one a plugin
    registered (validated by :func:`check_registered`)."""
    return Field(default, description=description, json_schema_extra={"registry": registry, "builtin": list(builtin)})


def check_registered(section: type[BaseModel], field_name: str, name: str) -> str:
    """``name`` if the registry behind ``section.field_name`` holds it, else a ValueError listing the
    registered names. The algorithm library (and torch) is imported only for a name not built in."""
    extra = section.model_fields[field_name].json_schema_extra
    assert isinstance(extra, dict), f"{section.__name__}.{field_name} is not a registered() field"
    if name in extra["builtin"]:  # type: ignore[operator]
        return name
    from raylign.algorithms import registry

    functions = getattr(registry, str(extra["registry"]))
    if name in functions:
        return name
    raise ValueError(
        f"unknown {functions.kind} {name!r}; registered: {', '.join(functions.names())}. A name your own code "
        "registers needs that code listed in `plugins` (a .py file or a module)"
    )


def _type_text(annotation: Any, extra: Any = None) -> str:
    if isinstance(extra, dict) and "builtin" in extra:
        return "one of " + " | ".join(extra["builtin"]) + " | a name a plugin registers"
    if get_origin(annotation) is Literal:
        return "one of " + " | ".join(str(a) for a in get_args(annotation))
    name = getattr(annotation, "__name__", None)
    if name and not get_args(annotation):
        return name
    return str(annotation).replace("typing.", "")


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    if get_origin(annotation) is list:
        (item,) = get_args(annotation) or (None,)
        if isinstance(item, type) and issubclass(item, BaseModel):
            return item
    return None


def describe_fields(
    cls: type[BaseModel], prefix: str = "", defaults: BaseModel | None = None
) -> list[tuple[str, str, str, str]]:
    """(dotted name, type, default, description) for every leaf field, for --help. ``defaults``: the
    section's default value where its parent's default sets some of its fields (RL's ``optim.lr``)."""
    rows: list[tuple[str, str, str, str]] = []
    for name, field in cls.model_fields.items():
        dotted = f"{prefix}{name}"
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows.append((dotted, "section", "", field.description or ""))
            if defaults is not None:
                section_default = getattr(defaults, name)
            else:
                section_default = None if field.is_required() else field.get_default(call_default_factory=True)
            rows.extend(describe_fields(annotation, dotted + ".", section_default))
            continue
        optional = _section_model(annotation)
        if optional is not None:  # a section that may be left out (None), e.g. rl's reward or reference
            rows.append((dotted, "optional section", "", f"{field.description or ''} (Optional: none by default.)"))
            rows.extend(describe_fields(optional, dotted + "."))
            continue
        item = _list_item_model(annotation)
        if item is not None:  # list of sections: describe one item's fields as name[].field
            rows.append((dotted, "section", "", f"{field.description or ''} Each item has these fields:".strip()))
            rows.extend(describe_fields(item, dotted + "[]."))
            continue
        type_text = _type_text(annotation, field.json_schema_extra)
        if defaults is not None and not field.is_required():
            default = repr(getattr(defaults, name))
        elif field.is_required():
            default = "(required)"
        elif field.default_factory is not None:
            default = repr(field.get_default(call_default_factory=True))
        else:
            default = repr(field.default)
        rows.append((dotted, type_text, default, field.description or ""))
    return rows
