"""Composes and validates an app's config, and the option lists of a grid.

A grid's hardware axis is ``grid.hardware`` when given; otherwise the
``hardware`` chosen on the command line (``hardware=h200_sxm``, or any
``hardware.<field>=`` override, which refers to the chosen one); otherwise
every option of the group, user search paths included. The same holds for
``model``; ``workload`` defaults to the chosen one. Each listed option is
composed with the user's other overrides, so ``hardware.mbu=0.7`` applies to
every listed GPU.

Every failure becomes one ``ConfigError`` line naming the key, the value and
what is allowed.

Composing costs. One composition of an app takes 0.6-2 s on a 2-core CPU
(Hydra's defaults tree, its pure-Python YAML reader, OmegaConf merges), over
half of it the measured profiles of ``calibration=auto`` (benchmarks/README.md,
"Time to first answer"). An option's composition reads only its groups'
nodes, and no shipped config writes into those from the ``calibration``
group (its profiles apply after composition: ``sweep.grid.calibration``),
so the option compositions choose ``calibration=roofline`` (``OPTION_CHOICES``)
unless an ``experiment`` is given (a global config may write anywhere).
Within ``composing_once`` an app is composed once per list of overrides:
the preflight's check and its placement of the run (``sweep.cli.commands``)
read the same composition.

Long numeric lists. Hydra's override grammar visits a list's elements through
a lookup that scans the list from its start (quadratic: one composition with
10,000 values took 24 s, benchmarks/README.md "Config parsing", and a run
composes a dozen times), and OmegaConf builds one node per value (0.1 to
0.4 ms each). ``stash_lists`` therefore
parses a plain list of numbers given to a numeric axis on the command line
itself, keeps the values in this process and hands Hydra the interpolation
``${axis_values:KEY}`` instead, which resolves to the Python list when the
config is converted to objects. ``config_yaml`` and ``restore`` put the
values back where a config or the command line is recorded.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

from hydra import compose
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from sweep.config.schema import ConfigError

SWEPT_GROUPS = ("hardware", "model", "workload")

LIST_KEYS = tuple(f"grid.{a}" for a in (
    "tensor_parallel", "concurrency", "token_budget", "context_tokens",
    "long_prompt_tokens", "traffic_tokens_per_day", "arrival_rate_per_s")) + (
    "search.tensor_parallel",)
"""Numeric axes whose command-line lists ``stash_lists`` parses itself."""

STASH_MIN_VALUES = 64
"""Shorter lists go through Hydra as usual (its error messages, its records)."""

_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")
_stash: dict[str, tuple[str, list[int | float]]] = {}  # key -> (override, values)


def _placeholder(key: str) -> str:
    return "${axis_values:" + key + "}"


def stashed_values(key: str) -> list[int | float]:
    """The OmegaConf resolver ``axis_values``: a stashed list, by its key."""
    if key not in _stash:
        raise KeyError(f"axis_values:{key}: no list of that key on the command line")
    return _stash[key][1]


def stash_lists(overrides: list[str]) -> list[str]:
    """The overrides with long plain-number axis lists swapped for placeholders."""
    out = []
    for o in overrides:
        key, eq, value = o.partition("=")
        if eq and key in LIST_KEYS and value[:1] == "[" and value[-1:] == "]":
            items = [x.strip() for x in value[1:-1].split(",")]
            if len(items) >= STASH_MIN_VALUES and all(
                    _FLOAT.fullmatch(x) for x in items):
                _stash[key] = (o, [int(x) if _INT.fullmatch(x) else float(x)
                                   for x in items])
                out.append(f"{key}={_placeholder(key)}")
                continue
        out.append(o)
    return out


def restore(overrides: list[str]) -> list[str]:
    """The overrides as the user wrote them (placeholders swapped back).

    Hydra's record of the command line holds the placeholder, or, once read
    through the config, the list it resolved to.
    """
    out = []
    for o in overrides:
        key, _, value = o.partition("=")
        original, values = _stash.get(key, (o, None))
        out.append(original if value in (_placeholder(key), str(values)) else o)
    return out


def config_yaml(cfg) -> str:
    """``OmegaConf.to_yaml(cfg)`` with stashed lists written out in full."""
    text = OmegaConf.to_yaml(cfg)
    for key, (_, values) in _stash.items():
        text = text.replace(_placeholder(key),
                            "[" + ", ".join(repr(v) for v in values) + "]")
    return text


def group_options(group: str, app: str, overrides: list[str]) -> list[str]:
    """Options of a config group, user search paths included (the schemas are
    not options: ``sweep.config.store``)."""
    return GlobalHydra.instance().config_loader().get_group_options(
        group, config_name=app, overrides=overrides)


def _one_line(e: BaseException) -> str:
    inner = e
    while inner is not None:  # a check of ours raised inside a resolver
        if isinstance(inner, ConfigError):
            return str(inner)
        inner = inner.__cause__ or inner.__context__
    cause = e.__cause__ or e.__context__
    text = str(cause if isinstance(cause, OmegaConfBaseException) else e)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    key = next((ln for ln in lines if ln.startswith("full_key:")), "")
    head = lines[0] if lines else type(e).__name__
    return f"{head} ({key})" if key and key not in head else head


_once: dict[tuple[str, tuple[str, ...]], tuple[DictConfig, str]] | None = None


@contextmanager
def composing_once() -> Iterator[None]:
    """Within: ``composed`` composes each app x overrides once, and hands out
    that composition again (read it, do not change it)."""
    global _once
    outer, _once = _once, {}
    try:
        yield
    finally:
        _once = outer


class HydraSettings(NamedTuple):
    """What the commands read of Hydra's own node of a composition."""

    run_dir: str  # ``hydra.run.dir``, unresolved
    mode: RunMode | None  # ``hydra.mode`` (None: as the command line says)


def composed(app: str, overrides: list[str]) -> tuple[DictConfig, HydraSettings]:
    """Hydra's composition of ``app``: the app's config (without Hydra's node,
    as ``compose`` returns it) and Hydra's settings the commands read."""
    key = (app, tuple(overrides))
    if _once is not None and key in _once:
        return _once[key]
    cfg = compose(config_name=app, overrides=overrides, return_hydra_config=True)
    hydra = HydraSettings(OmegaConf.to_container(cfg.hydra.run, resolve=False)["dir"],
                          cfg.hydra.mode)
    with open_dict(cfg):
        del cfg["hydra"]
    if _once is not None:
        _once[key] = cfg, hydra
        return _once[key]
    return cfg, hydra


def compose_object(app: str, overrides: list[str]):
    """Composes ``app`` with ``overrides`` and returns the validated dataclasses."""
    try:
        cfg, _ = composed(app, overrides)
        return OmegaConf.to_object(cfg)
    except AssertionError:
        # OmegaConf asserts when an override sets a field inside a null node
        raise ConfigError(_into_null(app, overrides)) from None
    except MissingConfigException as e:
        group, _, name = (e.missing_cfg_file or "").rpartition("/")
        if group and e.options is not None:
            raise ConfigError(f"{group}={name}: unknown option; allowed: "
                              f"{', '.join(e.options)}") from None
        raise ConfigError(_one_line(e)) from None
    except ConfigError:
        raise
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        raise ConfigError(_one_line(e)) from None


def _into_null(app: str, overrides: list[str]) -> str:
    """The message for an override that sets a field of a null section."""
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = [o.input_line for o in parsed if "." not in o.key_or_group]
    cfg = compose(config_name=app, overrides=choices)
    for o in parsed:
        parts = o.key_or_group.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if OmegaConf.select(cfg, parent, default="missing") is None:
                return (f"{o.input_line}: {parent} is null in this config, so it has "
                        f"no field {parts[i]!r}; allowed: choose a config that has a "
                        f"{parent} section (e.g. a workload with a trace)")
    return f"overrides {overrides}: one sets a field inside a null section"


def _root(override: str) -> str:
    """The top-level key or group an override chooses or edits."""
    return re.split(r"[./@=]", override.lstrip("+~"), maxsplit=1)[0]


def _named_groups(overrides: list[str]) -> set[str]:
    """Groups the command line chooses or edits (``g=...`` or ``g.field=...``)."""
    named = set()
    for o in OverridesParser.create().parse_overrides(overrides):
        root = o.key_or_group.split(".")[0].split("/")[0]
        if root in SWEPT_GROUPS:
            named.add(root)
    return named


OPTION_CHOICES = {"calibration": "roofline"}
"""Groups an option's composition chooses in place of the command line's
choice and fields (the cheapest option: no profiles), where the app has them
and no ``experiment`` is given (module docstring)."""


def grid_options(app: str, overrides: list[str], section: str = "grid",
                 groups: tuple[str, ...] = SWEPT_GROUPS,
                 every: tuple[str, ...] = ("hardware", "model")):
    """The validated app config and the option objects of each swept group.

    Args:
      section: the app's config node that lists options (``grid``, ``search``).
      groups: the groups swept.
      every: groups that default to every option (the others to the choice).

    Returns:
      ``(app_config, {group: [config objects]})``.
    """
    overrides = stash_lists(overrides)
    base = compose_object(app, overrides)
    named = _named_groups(overrides)
    names = {}
    for group in groups:
        listed = list(getattr(getattr(base, section), group))
        if listed:
            names[group] = listed
        elif group in named or group not in every:
            names[group] = None  # the composed choice
        else:
            names[group] = group_options(group, app, overrides)
    for group, listed in names.items():
        if listed is not None and len(set(listed)) != len(listed):
            raise ConfigError(
                f"{section}.{group} = {listed}: options must be distinct")
    # compose option i of every group together: max(len) compositions in all;
    # the section's own overrides (its axes) cannot change a group's options,
    # and a group used as chosen keeps its choice (its fields' overrides need it)
    listed_groups = {g for g, v in names.items() if v is not None}
    kept = [o for o in overrides
            if o.split("=")[0].lstrip("+~") not in (*listed_groups, "experiment")
            and not o.lstrip("+~").startswith(f"{section}.")]
    experiment = [o for o in overrides if o.split("=")[0].lstrip("+~") == "experiment"]
    if not experiment:
        cheap = {g: v for g, v in OPTION_CHOICES.items() if hasattr(base, g)}
        kept = [o for o in kept if _root(o) not in cheap] + [
            f"{g}={v}" for g, v in cheap.items()]
    out = {g: [] for g in groups}
    count = max(len(v) if v is not None else 1 for v in names.values())
    for i in range(count):
        choose = [f"{g}={v[i]}" for g, v in names.items()
                  if v is not None and i < len(v)]
        if not choose:
            break
        try:
            obj = compose_object(app, experiment + kept + choose)
        except ConfigError as e:
            msg = str(e)
            for g, v in names.items():
                if v is not None and i < len(v) and msg.startswith(f"{g}={v[i]}:"):
                    msg = f"{section}.{g} entry {msg}"
            raise ConfigError(msg) from None
        for g, v in names.items():
            if v is not None and i < len(v):
                out[g].append(getattr(obj, g))
    for g, v in names.items():
        if v is None:
            out[g] = [getattr(base, g)]
    proposers = list(getattr(getattr(base, section), "spec_proposer", []))
    if "model" in out and "draft" in proposers:
        _attach_drafts(app, section, out["model"],
                       [o for o in experiment + kept if _root(o) != "model"])
    if "model" in out and "eagle3" in proposers:
        _attach_eagle3_heads(section, out["model"])
    return base, out


def _attach_eagle3_heads(section: str, models: list) -> None:
    """Sets each model's ``eagle3`` to its EAGLE-3 head as a one-layer dense
    model (``roofline.eagle3_head_params``); in a grid, its ``draft`` too
    (the draft leaves of the grid's models: one loaded proposer per grid).

    The head's MLP is ``eagle3_intermediate_size`` wide where given (the
    head's own config: a MoE model's heads have a dense MLP of their own
    width), else the model's ``intermediate_size`` (a dense model's).

    Raises:
      ConfigError: a model with no head named, no MLP width for it, or
        experts and no ``eagle3_intermediate_size`` (one line).
    """
    from sweep.config.schema import Model
    from sweep.model import roofline

    for m in models:
        key = f"model[{m.name}]"
        width = m.eagle3_intermediate_size or (m.intermediate_size
                                               if m.num_experts == 1 else 0)
        why = (".eagle3_head is empty (no trained EAGLE-3 head is named for it; "
               "set model.eagle3_head=<its Hugging Face id>)" if not m.eagle3_head else
               f" has {m.num_experts} experts and eagle3_intermediate_size is 0 (a "
               "MoE model's head has a dense MLP of its own: set "
               "model.eagle3_intermediate_size=<the head's config.json "
               "intermediate_size>)" if not width and m.num_experts > 1 else
               ".intermediate_size is 0 (the head's layer has the model's MLP)"
               if not width else "")
        if why:
            raise ConfigError(f"{section}.spec_proposer lists eagle3: {key}{why}; "
                              f"allowed for {m.name}: ngram"
                              + ("" if not m.draft_model else ", draft"))
        n = float(roofline.eagle3_head_params(m.hidden_size, width,
                                              m.q_heads, m.kv_heads, m.head_dim))
        m.eagle3 = Model(name=f"{m.name}_eagle3", hf_id=m.eagle3_head, params=n,
                         active_params=n, layers=1, q_heads=m.q_heads,
                         kv_heads=m.kv_heads, head_dim=m.head_dim,
                         hidden_size=m.hidden_size, intermediate_size=width,
                         weight_dtype="bf16", kv_dtype=m.kv_dtype)
        if section == "grid":
            m.draft = m.eagle3


def _attach_drafts(app: str, section: str, models: list, overrides: list[str]) -> None:
    """Sets each model's ``draft`` to the config of its ``draft_model``.

    Raises:
      ConfigError: a model with no draft model, or one naming an unknown
        option or a draft that is not a small dense model of its own.
    """
    drafts: dict[str, object] = {}
    for m in models:
        key = f"model[{m.name}].draft_model"
        if not m.draft_model:
            raise ConfigError(
                f"{section}.spec_proposer lists draft: {key} is empty (no small "
                f"model of its tokenizer is shipped); allowed for {m.name}: ngram")
        if m.draft_model not in drafts:
            try:
                drafts[m.draft_model] = compose_object(
                    app, overrides + [f"model={m.draft_model}"]).model
            except ConfigError as e:
                msg = str(e).removeprefix(f"model={m.draft_model}: ")
                raise ConfigError(f"{key} = {m.draft_model!r}: {msg}") from None
        d = drafts[m.draft_model]
        if d.num_experts > 1 or d.active_params >= m.active_params:
            raise ConfigError(
                f"{key} = {m.draft_model!r}: must be a dense model smaller than "
                f"{m.name} ({d.active_params:g} active parameters, {m.name} "
                f"{m.active_params:g})")
        m.draft = d
