"""The one YAML reader for everything a user or a run directory hands us: safe types only, and limits
that a small file cannot get past (a 700-byte alias bomb would otherwise expand to gigabytes when the
settings are walked or printed; 5,000 nested brackets would overflow the parser's recursion).
"""

from __future__ import annotations

from typing import Any

import yaml

from grpo.config.errors import ConfigError


class YAMLSyntaxError(ConfigError):
    """Text that is not YAML at all (as opposed to YAML past a limit); `detail` is the parser's message."""

    def __init__(self, message: str, detail: str):
        super().__init__(message)
        self.detail = detail


MAX_CHARS = 1_000_000  # a config, a saved config.yaml: kilobytes
MAX_DEPTH = 50  # sections hold settings; a list of dicts in a setting is as deep as a config goes
MAX_NODES = 100_000  # counted through aliases, so each expansion counts


def load_yaml(text: str, what: str) -> Any:
    """`text` parsed with yaml.SafeLoader, or a ConfigError naming `what` and the limit it broke."""
    if len(text) > MAX_CHARS:
        raise ConfigError(f"{what} is {len(text):,} characters of YAML; the limit is {MAX_CHARS:,}.")
    loader = None
    try:
        loader = yaml.SafeLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _check_size(node, what)
        return loader.construct_document(node)
    except RecursionError:
        raise ConfigError(
            f"{what} nests deeper than YAML can be read here (limit {MAX_DEPTH} levels)."
        ) from None
    except yaml.YAMLError as e:
        raise YAMLSyntaxError(f"{what} is not valid YAML: {_short(str(e))}", str(e)) from None
    finally:
        if loader is not None:
            loader.dispose()


def _check_size(root: yaml.Node, what: str) -> None:
    """Walk the node tree as construction would expand it (aliases point at shared nodes), iteratively."""
    count, stack = 0, [(root, 1)]
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH:
            raise ConfigError(f"{what} nests more than {MAX_DEPTH} levels deep; a config needs a few.")
        if count > MAX_NODES:
            raise ConfigError(
                f"{what} expands to more than {MAX_NODES:,} YAML values (aliases repeat what they point at); "
                "a config needs a few hundred. Is it a YAML alias bomb?"
            )
        if isinstance(node, yaml.SequenceNode):
            stack.extend((child, depth + 1) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            _refuse_duplicate_keys(node, what)
            stack.extend((part, depth + 1) for pair in node.value for part in pair)


def _refuse_duplicate_keys(node: yaml.MappingNode, what: str) -> None:
    """YAML resolves a key written twice to its last value, silently (`optim:` twice keeps the second)."""
    seen: dict[tuple[str, str], int] = {}
    for key, _ in node.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":  # `<<:` merges
            continue
        line = key.start_mark.line + 1
        first = seen.get((key.tag, key.value))
        if first is not None:
            raise ConfigError(
                f"{what}: the key '{key.value}' is written twice (lines {first} and {line}); YAML would "
                "keep only the last. Merge them into one."
            )
        seen[key.tag, key.value] = line


def _short(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "…"
