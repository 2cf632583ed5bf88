"""Structured output requests -> an llguidance grammar (``SamplingParams.grammar``), checked here.

Accepted (the rest of these fields' values are a 400 naming the field):
- ``response_format``: ``{"type": "text"}`` (no grammar), ``{"type": "json_object"}`` (any JSON
  object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (the schema;
  ``strict`` changes nothing: the output always follows the schema).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or a JSON string),
  ``json_object: true``, ``regex``, ``choice`` (a list of strings: the output is one of them).

JSON is generated compact (llguidance's ``whitespace_flexible: false``: fixed separators, no free
whitespace between tokens), so a model cannot loop on whitespace until ``max_tokens``. The grammar is
validated against the model's tokenizer on the ingress' prepare thread (a schema or
regex llguidance cannot use is a 400 with its message); results are cached by grammar text. The worker
builds its own matcher from the same text (workers/grammar.py). Not combinable with ``ignore_eos``
(a finished grammar allows only EOS) or ``min_tokens`` > 0 (which bans EOS): both are a 400.
"""

from __future__ import annotations

import functools
import json
import re

from .errors import bad_request

MAX_GRAMMAR_CHARS = 256 * 1024


def schema_grammar(schema, param: str) -> str:
    from pagedray.workers.grammar import load_llguidance

    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise bad_request(f"{param}: the schema is not valid JSON: {exc}", param=param.split(".")[0]) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param=param.split(".")[0])
    # compact JSON (no free whitespace between tokens): with it, small models and sampled tokens can emit
    # whitespace until max_tokens runs out (the whitespace-loop failure mode of JSON mode)
    return load_llguidance().LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})


def _regex_grammar(pattern) -> str:
    from pagedray.workers.grammar import load_llguidance

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
        return schema_grammar(spec["schema"], "response_format.json_schema.schema")
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


class GrammarChecker:
    """Validates grammars against the model's tokenizer (built on first use), cached by grammar text."""

    def __init__(self, tokenizer) -> None:
        self._hf_tokenizer = tokenizer
        self._lltokenizer = None

    @functools.lru_cache(maxsize=256)   # noqa: B019 - one checker per ingress replica, lives as long
    def error(self, grammar: str) -> str:
        """'' when llguidance accepts ``grammar`` for this tokenizer, else its message."""
        from pagedray.workers.grammar import load_llguidance

        llguidance = load_llguidance()
        if self._lltokenizer is None:
            self._lltokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer)
        return llguidance.LLMatcher.validate_grammar(grammar, self._lltokenizer)

    def check(self, field: str, grammar: str) -> None:
        message = self.error(grammar)
        if message:
            raise bad_request(f"{field}: the grammar cannot be used: {message.strip()}", param=field)
