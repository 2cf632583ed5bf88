"""The ``qwen3_xml`` tool-call format (Qwen3-Coder, Qwen3.5, Qwen3.6): the states that read it, a part of
tool_parsers.py's ``ToolCallStream`` (a mixin: it reads and writes the stream's fields and calls its
helpers; the contract is there). A call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

- The call is committed (its header sent) at the ``>`` of ``<function=NAME>`` when NAME is a known
  function; anything else there (an unknown name, a name over 64 characters, no ``<function=``) is
  content from the marker up to the name, as in the other formats. ``<tool_call>`` followed by ``{`` is
  read as a hermes block (these models sometimes write one). An output that starts with ``<function=``
  (the ``<tool_call>`` left out) is read as a call too.
- Its arguments are a JSON object built here: each parameter, once its value has ended, is sent as one
  piece (``{"city": "Oslo"``, then ``, "days": 3``), and ``}`` (or ``{}`` without parameters) when the
  function ends, so the pieces concatenated are the object. A value is the text after ``<parameter=KEY>``
  up to ``</parameter>`` (or, the closing tag left out, up to ``<parameter=``, ``</function>`` or
  ``</tool_call>``), less one leading and one trailing newline. With a schema in the request's tools
  (``ToolPlan.parameter_types``) a value becomes the JSON type declared for it: integer / number / boolean
  / object / array / null values are parsed as JSON or, failing that, as a Python literal (the template
  renders earlier calls' values with Jinja's ``string``: ``True``, ``{'unit': 'C'}``), and kept as the
  string when they do not parse to a declared type (or to JSON: no sets, NaN, ...); a declared string, no
  type, or no schema keeps the text. A key that does not close with ``>`` within 256 characters is dropped with
  whatever follows it up to the next tag.
- After ``</function>`` a next ``<function=`` in the same block is the next call; else everything up to
  ``</tool_call>`` (or a next ``<tool_call>``) is the block's and is dropped.
- A call cut short (``max_tokens``) is closed at the end of the output: the parameters that ended are
  kept, one whose value was still being written is dropped.
"""

from __future__ import annotations

import ast
import json
import re

_TOOL_OPEN, _TOOL_CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_MAX_KEY = 256
_MAX_NAME = 64
_NAME = re.compile(r"[A-Za-z0-9_.-]*")
_WS = re.compile(r"\s*")
# what may follow a committed function's parameters, and what ends a parameter's value
_BETWEEN = (PARAMETER, FUNCTION_END, _TOOL_CLOSE, _TOOL_OPEN)
_VALUE_ENDS = (PARAMETER_END, PARAMETER, FUNCTION_END, _TOOL_CLOSE)
_FIND = {words: re.compile("|".join(re.escape(w) for w in words)) for words in (_BETWEEN, _VALUE_ENDS)}
_KEY_END = re.compile(r"[>\n]")
_NOT_JSON = object()
_TYPES = {"integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
          "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          "boolean": lambda v: isinstance(v, bool), "object": lambda v: isinstance(v, dict),
          "array": lambda v: isinstance(v, list), "null": lambda v: v is None}


def _find(words: tuple[str, ...], text: str, pos: int) -> tuple[int, str | None]:
    """The first of ``words`` in ``text[pos:]``: (where, word); else (where, None): the text from ``where``
    may still begin one (hold it), or ``where`` is its end."""
    m = _FIND[words].search(text, pos)
    if m is not None:
        return m.start(), m.group()
    for k in range(min(max(map(len, words)) - 1, len(text) - pos), 0, -1):
        if any(w.startswith(text[len(text) - k:]) for w in words):
            return len(text) - k, None
    return len(text), None


def _reject(name: str):
    raise ValueError(f"{name} is not JSON")


def _parsed(word: str):
    """The JSON value of ``word`` read as JSON, else as a Python literal (made JSON: tuples become lists;
    sets, bytes, non-finite numbers are not JSON), else _NOT_JSON."""
    try:
        value = json.loads(word, parse_constant=_reject)
        json.dumps(value, allow_nan=False)   # 1e999 reads as inf
        return value
    except (ValueError, RecursionError):
        pass
    try:
        return json.loads(json.dumps(ast.literal_eval(word), allow_nan=False))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return _NOT_JSON


def typed_value(text: str, types: tuple[str, ...]):
    """A parameter's value as the JSON types its schema declares (``types``; see the module docstring)."""
    if not types or "string" in types:
        return text
    value = _parsed(text.strip())
    if value is not _NOT_JSON and any(_TYPES.get(t, lambda v: False)(value) for t in types):
        return value
    return text


class Qwen3XmlCalls:
    """The ``qwen3_xml`` states (module docstring). ``_xml_open``: after ``<tool_call>``; ``_xml_function``:
    at ``<function=``; ``_xml_params``: between a committed function's parameters; ``_xml_key``: a
    parameter's key from ``_mark``; ``_xml_value``: its value from ``_mark``; ``_xml_next``: after
    ``</function>``. ``_xml_args``: None outside a call, else how many parameters were sent."""

    XML_HOLDS_MARK = frozenset({"_xml_key", "_xml_value"})

    def _xml_open(self) -> bool:
        if not self._skip_ws():
            return False
        if self._text[self._pos] == "{":     # a hermes block inside the Qwen tags
            self._seq = "block"
            return self._goto(self._open_object)
        return self._goto(self._xml_function)

    def _xml_function(self) -> bool:
        text, pos = self._text, self._pos
        head = text[pos:pos + len(FUNCTION)]
        if head != FUNCTION:
            return False if len(head) < len(FUNCTION) and FUNCTION.startswith(head) else self._fail(pos)
        start = pos + len(FUNCTION)
        end = _NAME.match(text, start).end()
        if end - start > _MAX_NAME:
            return self._fail(start)
        if end == len(text):
            return False
        if text[end] != ">" or text[start:end] not in self._names:
            return self._fail(start)
        self._commit(text[start:end])
        self._name, self._xml_args, self._pos = text[start:end], 0, end + 1
        return self._goto(self._xml_params)

    def _xml_params(self) -> bool:
        text = self._text
        where, word = _find(_BETWEEN, text, self._pos)
        self._pos = where                    # the text before it is the call's: dropped
        if word is None:
            return False
        if word == PARAMETER:
            self._pos = self._mark = where + len(PARAMETER)
            return self._goto(self._xml_key)
        self._xml_close()
        if word == FUNCTION_END:
            self._pos = where + len(FUNCTION_END)
            return self._goto(self._xml_next)
        return self._goto(self._swallow)     # </tool_call> or <tool_call>: the block's end reads it

    def _xml_key(self) -> bool:
        text = self._text
        m = _KEY_END.search(text, self._pos, self._mark + _MAX_KEY + 1)
        if m is None:
            if len(text) <= self._mark + _MAX_KEY:
                self._pos = len(text)
                return False
            self._pos = self._mark           # no key: the tag is dropped, the text after it read again
            return self._goto(self._xml_params)
        if m.group() != ">":
            self._pos = m.start()
            return self._goto(self._xml_params)
        self._key, self._pos = text[self._mark:m.start()], m.end()
        self._mark = self._pos
        return self._goto(self._xml_value)

    def _xml_value(self) -> bool:
        text = self._text
        where, word = _find(_VALUE_ENDS, text, self._pos)
        self._pos = where
        if word is None:
            return False
        value = text[self._mark:where]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        self._xml_parameter(self._key, value)
        if word == PARAMETER_END:
            self._pos = where + len(PARAMETER_END)
        return self._goto(self._xml_params)

    def _xml_next(self) -> bool:
        """After ``</function>``: the block's next function, or its end."""
        if not self._skip_ws():
            return False
        text, pos = self._text, self._pos
        head = text[pos:pos + len(FUNCTION)]
        if head == FUNCTION:
            self._start = pos
            return self._goto(self._xml_function)
        if len(head) < len(FUNCTION) and FUNCTION.startswith(head):
            return False
        return self._goto(self._swallow)

    def _xml_parameter(self, key: str, value: str) -> None:
        typed = typed_value(value, self._plan.parameter_types(self._name, key))
        piece = json.dumps(key, ensure_ascii=False) + ": " + json.dumps(typed, ensure_ascii=False)
        self._arguments_text(("{" if self._xml_args == 0 else ", ") + piece)
        self._xml_args += 1

    def _xml_close(self) -> None:
        if self._xml_args is not None:
            self._arguments_text("{}" if self._xml_args == 0 else "}")
            self._xml_args = None

    def _xml_finish(self) -> None:
        """At the end of the output: a call still open is closed (a value cut short is dropped)."""
        self._xml_close()
