"""YAML loading, dotted command-line overrides, and one-sentence errors.

    cfg = load_stage_config("configs/demo/rl_stage1.yaml", ["optimizer.lr=1e-6", "rollout.temperature=1.1"])

Override values are parsed as YAML scalars/lists (`1e-6` -> float, `[0.9,0.95]` -> list, `null` -> None).
Every failure raises `ConfigError` whose message names the field, the value and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import TypeAdapter, ValidationError

from infir2_rl.config.stage import PipelineConfig, RlStageConfig, SftStageConfig, StageConfig
from infir2_rl.strict_model import BOOL_NOT_NUMBER


class ConfigError(ValueError):
    """A config that cannot run; the message is one sentence meant for the user."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key written twice in one mapping (PyYAML keeps the last silently, so
    an edited config could run with a value its author did not see)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None,
                    f"key {key!r} appears twice in one mapping (lines {seen[key] + 1} and {key_node.start_mark.line + 1}):"
                    " keep one",
                    key_node.start_mark,
                )  # fmt: skip
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem and its position (PyYAML puts the position on a line of its own,
    which a one-line error would drop)."""
    mark = getattr(e, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    return f"{where}: {getattr(e, 'problem', None) or str(e).splitlines()[0]}"


def read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"config file {str(path)!r} is a directory; pass the path of a YAML file")
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist; pass the path of a YAML file")
    try:
        data = yaml.load(path.read_text(), Loader=_UniqueKeyLoader)
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not UTF-8 text ({e.reason}); pass a YAML file"
        ) from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML{_yaml_problem(e)}") from e
    if data is None:
        raise ConfigError(f"config file {str(path)!r} is empty; a stage or pipeline YAML needs its settings")
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping at the top, not {type(data).__name__}"
        )
    return data


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `a.b.c=value` overrides to a nested dict (in place, also returned)."""
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {item!r}: write it as section.field=value, e.g. optimizer.lr=1e-6")
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML{_yaml_problem(e)}") from e
        if isinstance(value, str):
            value = _number_or_str(value)
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {part!r} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def _number_or_str(text: str) -> Any:
    """YAML 1.1 reads `1e-6` (no dot) as a string; on the command line it means a number."""
    try:
        return float(text) if any(c in text for c in ".eE") else int(text)
    except ValueError:
        return text


def _format_error(err: ValidationError) -> str:
    """Turn pydantic's report into one sentence: field=value: problem; fix."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if p not in ("sft", "rl")]
    field = ".".join(loc) or "config"
    kind = first["type"]
    value = first.get("input")
    msg = first["msg"]
    if kind == "extra_forbidden":
        return f"{field}: unknown key; check its spelling against `infir2-rl check-config` output"
    if kind == "missing":
        return f"{field} is missing: add it to the config"
    if kind == "value_error":
        return msg.removeprefix("Value error, ")
    if kind == BOOL_NOT_NUMBER:  # raised by the section holding the key: msg starts with the key
        return f"{field}.{msg}" if loc else msg
    if kind == "union_tag_invalid" or kind == "union_tag_not_found":
        return "kind: must be 'sft' or 'rl'"
    more = f" (and {len(err.errors()) - 1} more problem(s))" if len(err.errors()) > 1 else ""
    return f"{field}={value!r}: {msg.lower()}{more}"


_STAGE_ADAPTER: TypeAdapter[SftStageConfig | RlStageConfig] = TypeAdapter(StageConfig)


def parse_stage_config(data: dict[str, Any]) -> SftStageConfig | RlStageConfig:
    data = dict(data)
    data.setdefault("kind", "sft")
    try:
        return _STAGE_ADAPTER.validate_python(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def load_stage_config(path: str | Path, overrides: Sequence[str] = ()) -> SftStageConfig | RlStageConfig:
    return parse_stage_config(apply_overrides(read_yaml(path), overrides))


def load_pipeline_config(path: str | Path, overrides: Sequence[str] = ()) -> PipelineConfig:
    data = apply_overrides(read_yaml(path), overrides)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e)) from None


def is_pipeline_file(path: str | Path) -> bool:
    return "stages" in read_yaml(path)


def load_pipeline_stages(
    pipeline: PipelineConfig, pipeline_path: str | Path
) -> list[tuple[str, SftStageConfig | RlStageConfig | None]]:
    """Resolve every stage of a pipeline (cast steps give None): file, overrides, run_dir."""
    base = Path(pipeline_path).parent
    out: list[tuple[str, SftStageConfig | RlStageConfig | None]] = []
    for st in pipeline.stages:
        if st.kind == "cast_fp8":
            out.append((st.name, None))
            continue
        assert st.config is not None
        try:
            data = apply_overrides(read_yaml(base / st.config), st.overrides)
            data["name"] = st.name
            data["run_dir"] = str(Path(pipeline.run_dir) / st.name)
            out.append((st.name, parse_stage_config(data)))
        except ConfigError as e:
            raise ConfigError(f"stage {st.name!r} ({st.config}): {e}") from None
    return out


def dump_config(cfg: SftStageConfig | RlStageConfig | PipelineConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
