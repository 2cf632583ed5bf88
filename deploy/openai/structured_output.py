"""Structured output requests -> an llguidance grammar (``SamplingParams.grammar``), checked here.

Accepted (the rest of these fields' values are a 400 naming the field):
- ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the schema).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or a JSON string),
  ``json_object: true``, ``regex``, ``choice`` (a list of strings: the output is one of them).

Strict by default (as xgrammar's strict mode and OpenAI's ``strict: true``): an object schema that lists
``properties`` and leaves ``additionalProperties`` unset gets ``additionalProperties: false``
(``closed_objects``), so a model cannot add keys the schema does not name and run on until
``max_tokens``. Opt out per schema with ``"strict": false`` (``json_schema``, or a function tool) or by
setting ``additionalProperties`` yourself; an object schema without ``properties`` (``json_object``,
``{"type": "object"}``) stays open.

JSON is generated compact (llguidance's ``whitespace_flexible: false``: fixed separators, no free
whitespace between tokens), so a model cannot loop on whitespace until ``max_tokens``. Not combinable
with ``ignore_eos`` (a finished grammar allows only EOS) or ``min_tokens`` > 0 (which bans EOS): both
are a 400.

Checks, all before the request is admitted, on the ingress' prepare thread (never the engine's step
thread); each failure is a 400 naming the field:
- A schema is nested at most ``MAX_SCHEMA_DEPTH`` (64) levels of JSON objects and arrays (llguidance's
  JSON parser stops at 128; a schema given as a JSON string too deep for Python's parser is refused
  the same way), and its grammar text is at most ``MAX_GRAMMAR_CHARS``.
- A schema must have a finite instance: ``has_finite_instance`` refuses a ``$ref`` cycle that every
  instance must follow (``{"$ref": "#"}``, a required property or a ``minItems`` item whose schema is
  the object itself). Without this the model could only stop at ``max_tokens``.
- ``GrammarChecker`` compiles the grammar against the model's tokenizer under the shared limits
  (workers/sampling/grammar_limits.py), computes its first token mask, takes one step along the lowest allowed
  token and computes the second mask: a grammar llguidance cannot use, one past its time or size
  budget, one that matches no text, and one whose lexer explodes on its first step (``(a{1000}){1000}``)
  fail here instead of in the engine. The message is llguidance's short error (first line and reason,
  at most 200 characters: ``grammar_limits.short_error``), never parser state. Results are cached by
  grammar text. The worker
  builds its own matcher from the same text under the same limits (workers/sampling/grammar.py).
"""

from __future__ import annotations

import functools
import json
import re
import urllib.parse

from pagedray.workers.sampling.grammar_limits import short_error

from .errors import bad_request

MAX_GRAMMAR_CHARS = 256 * 1024
MAX_SCHEMA_DEPTH = 64
_NO_FINITE_INSTANCE = ("the schema has no finite instance: every instance must follow a $ref cycle (for "
                       "example a required property whose schema is the object itself)")


def nesting_depth(value, limit: int) -> int:
    """Levels of JSON objects / arrays in ``value`` (a scalar is 0); stops counting past ``limit``. Iterative."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if not isinstance(item, (dict, list)):
            continue
        deepest = max(deepest, depth)
        if depth > limit:
            break
        stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


def check_schema_depth(schema, what: str, param: str, limit: int = MAX_SCHEMA_DEPTH) -> None:
    if nesting_depth(schema, limit) > limit:
        raise bad_request(f"{what}: the schema is nested deeper than {limit} levels", param=param)


# JSON Schema keywords whose value is a schema, a list of schemas, or a map of names to schemas
_SCHEMA_VALUED = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
                  "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
NAMED_SCHEMAS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema):
    """A copy of ``schema`` in which every object schema that lists ``properties`` and leaves
    ``additionalProperties`` (and ``patternProperties`` / ``unevaluatedProperties``) unset allows no
    other keys. Literal values (``const``, ``enum``, ``default``) are not schemas and are left alone;
    the depth is bounded by ``check_schema_depth`` before this runs."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_VALUED:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(item) for item in out[key]]
    for key in NAMED_SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(item) for name, item in out[key].items()}
    if isinstance(out.get("properties"), dict) and not any(
            key in out for key in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def strict_flag(value, param: str) -> bool:
    """A schema's ``strict`` field: True unless it is ``false``; 400 naming it when not a boolean."""
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{param}: must be a boolean", param=param.split(".")[0])
    return value is not False


def schema_grammar(schema, param: str, max_depth: int = MAX_SCHEMA_DEPTH, strict: bool = True) -> str:
    """The grammar of a JSON schema (an object or its JSON text), checked as the module docstring says;
    ``param`` is the dotted path named in messages (its first part is the error's ``param``); ``strict``:
    close the object schemas (``closed_objects``)."""
    from pagedray.workers.sampling.grammar_limits import load_llguidance

    field = param.split(".")[0]
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except RecursionError:
            raise bad_request(f"{param}: the schema is nested deeper than {max_depth} levels", param=field) from None
        except ValueError as exc:
            raise bad_request(f"{param}: the schema is not valid JSON: {exc}", param=field) from None
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise bad_request(f"{param}: a JSON schema must be an object", param=field)
    check_schema_depth(schema, param, field, max_depth)
    if strict:
        schema = closed_objects(schema)
    if not has_finite_instance(schema):
        raise bad_request(f"{param}: {_NO_FINITE_INSTANCE}", param=field)
    # compact JSON (no free whitespace between tokens): with it, small models and sampled tokens can emit
    # whitespace until max_tokens runs out (the whitespace-loop failure mode of JSON mode)
    try:
        return load_llguidance().LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        raise bad_request(f"{param}: the schema cannot be used: {short_error(str(exc))}", param=field) from None


_MISSING = object()


def _resolve(root: dict, ref: str):
    """The subschema a local JSON-pointer ``$ref`` names (``#``, ``#/$defs/a``), or _MISSING."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return _MISSING
    node = root
    for token in ref[2:].split("/"):
        token = urllib.parse.unquote(token).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and token in node:
            node = node[token]
        elif isinstance(node, list) and token.isdigit() and int(token) < len(node):
            node = node[int(token)]
        else:
            return _MISSING
    return node


def _as_list(value) -> list:
    return value if isinstance(value, list) else []


class _FiniteInstances:
    """An AND / OR graph of "this subschema has a finite instance", solved by propagation (linear time).

    Each ``$ref`` target is one node compiled once (no recursion through refs); a cycle never becomes
    true. Whatever the analysis does not model (string formats, ``not``, ``if``, ``$id`` scopes, types
    other than object and array) counts as satisfiable: it only refuses what certainly loops, and
    llguidance reports the rest itself."""

    def __init__(self, root: dict) -> None:
        self.root = root
        self.needs: list[int] = []          # per node: children that must hold before it holds
        self.parents: list[list[int]] = []
        self.refs: dict[str, int] = {}
        self.pending: list[tuple[int, object]] = []
        self.unsure = False

    def node(self, children: list[int], need_all: bool) -> int:
        index = len(self.needs)
        self.needs.append(len(children) if need_all else 1)
        self.parents.append([])
        for child in children:
            self.parents[child].append(index)
        return index

    def schema(self, s) -> int:
        if s is False:
            return self.node([], need_all=False)
        if not isinstance(s, dict):
            return self.node([], need_all=True)
        if any(key in s for key in ("$dynamicRef", "$recursiveRef")) or ("$id" in s and s is not self.root):
            self.unsure = True
        parts = []
        if isinstance(s.get("$ref"), str):
            target = _resolve(self.root, s["$ref"])
            if target is not _MISSING:
                parts.append(self.ref(s["$ref"], target))
        parts += [self.schema(branch) for branch in _as_list(s.get("allOf"))]
        for key in ("anyOf", "oneOf"):
            if _as_list(s.get(key)):
                parts.append(self.node([self.schema(branch) for branch in s[key]], need_all=False))
        if "const" not in s and "enum" not in s:
            parts.append(self.typed(s))
        return self.node(parts, need_all=True)

    def ref(self, key: str, target) -> int:
        if key not in self.refs:
            self.refs[key] = self.node([], need_all=False)
            self.pending.append((self.refs[key], target))
        return self.refs[key]

    def typed(self, s: dict) -> int:
        types = s.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or any(t not in ("object", "array") for t in types):
            return self.node([], need_all=True)
        return self.node([self.object(s) if t == "object" else self.array(s) for t in types], need_all=False)

    def object(self, s: dict) -> int:
        props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
        extra = s.get("additionalProperties")
        needs = []
        for name in dict.fromkeys(r for r in _as_list(s.get("required")) if isinstance(r, str)):
            if name in props:
                needs.append(self.schema(props[name]))
            elif isinstance(extra, dict) and not s.get("patternProperties"):
                needs.append(self.schema(extra))
        return self.node(needs, need_all=True)

    def array(self, s: dict) -> int:
        prefix, items = s.get("prefixItems"), s.get("items")
        if isinstance(items, list):   # draft 4-7 tuples
            prefix, items = items, s.get("additionalItems")
        prefix = _as_list(prefix)
        low = s.get("minItems", 0)
        low = low if isinstance(low, int) and not isinstance(low, bool) else 0
        needs = [self.schema(item) for item in prefix[:max(low, 0)]]
        if low > len(prefix) and items is not None:
            needs.append(self.schema(items))
        return self.node(needs, need_all=True)

    def solve(self, root: int) -> bool:
        while self.pending:
            ref, target = self.pending.pop()
            self.parents[self.schema(target)].append(ref)
        holds = [need == 0 for need in self.needs]
        queue = [i for i, h in enumerate(holds) if h]
        while queue:
            for parent in self.parents[queue.pop()]:
                self.needs[parent] -= 1
                if self.needs[parent] == 0 and not holds[parent]:
                    holds[parent] = True
                    queue.append(parent)
        return holds[root] or self.unsure


def has_finite_instance(schema: dict) -> bool:
    """False only when no finite JSON value can match ``schema`` because of ``$ref`` cycles (see
    ``_FiniteInstances``); the schema's nesting depth must be bounded (``check_schema_depth``) first."""
    graph = _FiniteInstances(schema)
    return graph.solve(graph.schema(schema))


def _regex_grammar(pattern) -> str:
    from pagedray.workers.sampling.grammar_limits import load_llguidance

    return load_llguidance().LLMatcher.grammar_from_regex(pattern)
def _from_response_format(value) -> str | None:
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise bad_request("response_format: must be an object with a 'type'", param="response_format")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar({"type": "object"}, "response_format")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise bad_request("response_format.json_schema: must be an object with a 'schema'",
                              param="response_format")
        strict = strict_flag(spec.get("strict"), "response_format.json_schema.strict")
        return schema_grammar(spec["schema"], "response_format.json_schema.schema", strict=strict)
    raise bad_request(f"response_format: type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                      param="response_format")


def _from_structured_outputs(value) -> str | None:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise bad_request(f"{param}: must be an object", param=param)
    given = {key: item for key, item in value.items() if item not in (None, False)}
    kinds = set(given) & {"json", "json_object", "regex", "choice"}
    if set(given) - kinds:
        raise bad_request(f"{param}: unsupported keys {sorted(set(given) - kinds)} (json, json_object, regex, "
                          "choice are supported)", param=param)
    if len(kinds) != 1:
        raise bad_request(f"{param}: give exactly one of json, json_object, regex, choice", param=param)
    kind = kinds.pop()
    item = given[kind]
    if kind == "json":
        return schema_grammar(item, f"{param}.json")
    if kind == "json_object":
        return schema_grammar({"type": "object"}, param)
    if kind == "regex":
        if not isinstance(item, str):
            raise bad_request(f"{param}.regex: must be a string", param=param)
        return _regex_grammar(item)
    if not (isinstance(item, list) and item and all(isinstance(c, str) for c in item)):
        raise bad_request(f"{param}.choice: must be a non-empty list of strings", param=param)
    return _regex_grammar("|".join(re.escape(c) for c in item))


def requested_grammar(extra: dict) -> tuple[str, str] | None:
    """(the field that asked, the llguidance grammar) for a request's extra fields, or None."""
    grammars = []
    for field, build in (("response_format", _from_response_format), ("structured_outputs", _from_structured_outputs)):
        if extra.get(field) is not None:
            grammar = build(extra[field])
            if grammar is not None:
                grammars.append((field, grammar))
    if len(grammars) > 1:
        raise bad_request("structured_outputs: give either response_format or structured_outputs, not both",
                          param="structured_outputs")
    if grammars and len(grammars[0][1]) > MAX_GRAMMAR_CHARS:
        raise bad_request(f"{grammars[0][0]}: the grammar exceeds {MAX_GRAMMAR_CHARS} characters",
                          param=grammars[0][0])
    return grammars[0] if grammars else None



def _lowest_allowed(row, skip: int) -> int | None:
    """The lowest token id set in one bitmask row (int32 words, 32 tokens each) other than ``skip``."""
    for word in row.nonzero().flatten().tolist():
        bits = int(row[word]) & 0xFFFFFFFF
        while bits:
            low = bits & -bits
            token = word * 32 + low.bit_length() - 1
            if token != skip:
                return token
            bits ^= low
    return None


def _first_two_masks(llguidance, matcher, tokenizer) -> None:
    """The first mask, one step along the lowest allowed token other than EOS, the second mask (stops
    at the first error: the matcher keeps it)."""
    bitmask = llguidance.torch.allocate_token_bitmask(1, tokenizer.vocab_size)
    if matcher.is_error():
        return
    llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
    token = None if matcher.is_error() else _lowest_allowed(bitmask[0], tokenizer.eos_token)
    if token is not None and matcher.consume_token(token) and not matcher.is_error():
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)


class GrammarChecker:
    """Compiles grammars against the model's tokenizer (built on first use) and runs their first two masks
    under ``grammar_limits()``; results cached by grammar text. Runs on the caller's thread (the prepare
    thread); llguidance drops the GIL while it compiles and computes masks."""

    def __init__(self, tokenizer) -> None:
        self._hf_tokenizer = tokenizer
        self._lltokenizer = None

    def _tokenizer(self, llguidance):
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
        return self._lltokenizer

    @functools.lru_cache(maxsize=256)   # noqa: B019 - one checker per ingress replica, lives as long
    def error(self, grammar: str) -> str:
        """'' when llguidance can run ``grammar`` for this tokenizer within the limits, else a short message."""
        from pagedray.workers.sampling.grammar_limits import grammar_limits, load_llguidance

        llguidance = load_llguidance()
        tokenizer = self._tokenizer(llguidance)
        try:
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=grammar_limits())
            _first_two_masks(llguidance, matcher, tokenizer)
        except BaseException as exc:   # a panic in llguidance (pyo3's PanicException is a BaseException)
            if type(exc).__name__ != "PanicException":
                raise
            return "llguidance failed on it"
        return short_error(matcher.get_error()) if matcher.is_error() else ""

    def check(self, field: str, grammar: str) -> None:
        message = self.error(grammar)
        if message:
            raise bad_request(f"{field}: the grammar cannot be used: {message}", param=field)
