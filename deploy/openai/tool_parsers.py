"""Streaming tool-call parsers: a choice's output text, as it arrives -> OpenAI chat-chunk ``delta`` dicts.

``ToolCallStream(plan, parser)`` is fed the text of one choice piece by piece (``feed``), then ``finish``ed
once. Each returns the deltas that the text read so far decides, in order:
``{"content": "..."}``; a new call ``{"tool_calls": [{"index": i, "id": "call_<24 hex>", "type": "function",
"function": {"name": ..., "arguments": ""}}]}``; a piece of its arguments ``{"tool_calls": [{"index": i,
"function": {"arguments": "..."}}]}`` (what the openai client's stream accumulator merges; ``i`` counts the
calls of the choice from 0). ``made_calls`` turns True with the first call: the caller then reports the
finish reason ``"stop"`` as ``"tool_calls"``. ``parse_tool_calls`` (tools.py) is one stream fed the whole
text, its deltas merged by ``merge_tool_deltas``.

The contract:
- Split invariance: for any text and any split of it into ``feed`` pieces, the merged deltas (content
  concatenated; calls by index, id and name from their first delta, arguments concatenated) are the same.
  Every decision waits until the text that settles it has arrived and never depends on where pieces end.
- Content streams as it arrives. Held back are only a suffix that may still begin a call marker, the text
  of a call that is not settled yet (released as content when it turns out not to be one), and
  whitespace whose fate depends on what follows: content is stripped where it meets calls. Whitespace at
  the end of the content is dropped when the choice made calls (else sent at the end); whitespace at its
  start is dropped when a call came before it. Empty content is no content (``None`` once merged).
- A call is committed (its header delta sent) once its name is complete and is one of ``plan.names`` and
  its arguments are seen to be a JSON object (the ``{`` after ``"arguments":`` / ``"parameters":``; an
  object without either is a call with ``{}`` once it closes). Its arguments then stream as the raw text the
  model writes, from that ``{`` to the matching ``}`` (string-aware), less whitespace outside strings at the
  end. Arguments that turn out malformed (``NaN``, a bad escape) or cut short (``max_tokens``) stay as
  written: the call is not taken back (OpenAI and vLLM do the same). Keys may come in any order; arguments
  written before the name are held and sent whole with the header. (pythonic, qwen3_xml: the arguments are
  built here, not the model's text; see their sections.)
- Text where no known name can be read (not a JSON object, a name that is not a known string, arguments
  that are not an object, a key or name string over 256 characters) stays content, from the marker up to
  where the reading failed; reading for calls resumes there (harmony: the message's body, its header and
  markers dropped). Parsing never raises and is linear.
- ``plan.parallel`` false: at most one call. Later calls are read as calls and dropped (neither content nor
  calls), as the non-streamed parser always did.

Formats (``parser``; ``plan.choice`` "required" / "named" ignore it):
- ``hermes`` (Qwen2.5, Qwen3, Hermes, and any model prompted by tools.py's system prompt): blocks
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one per call. After a committed call
  everything up to ``</tool_call>`` is the block's (stray braces are dropped); a ``<tool_call>`` first
  starts the next block. Inside a block, a ``<`` outside JSON strings ends the arguments (the model closed
  the block on unbalanced braces). Also, as before, an output whose first non-space character is ``{`` is read as
  ``llama3_json`` objects (Llama 3 models under a template that asked for Hermes blocks).
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the output (or what follows ``<|python_tag|>``) is
  ``{"name": ..., "parameters": {...}}`` objects separated by ``;``. After a call's object closes, anything
  but ``;`` ends the calls and is content.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` objects (what follows the
  array is content), or the newer ``[TOOL_CALLS]name[ARGS]{...}`` form, one marker per call. An output that
  starts with ``[`` is read as such an array (the marker skipped by the detokenizer).
- ``pythonic`` (Llama 3.2 pythonic / Llama 4 templates): ``[get_weather(city="Oslo"), get_time()]`` at the
  start of the output (or after ``<|python_start|>``); keyword arguments of Python literals (and JSON's
  ``true`` / ``false`` / ``null``) become a JSON object. A call is sent whole (header, then its arguments as
  ``json.dumps`` writes them) once its closing parenthesis arrives; one cut short stays content, and so
  does a list's entry that is not a known call with literal keyword arguments (the calls before it stay).
- ``qwen3_xml`` (Qwen3-Coder, Qwen3.5, Qwen3.6): ``<tool_call>`` blocks holding ``<function=NAME>`` and
  ``<parameter=KEY>`` tags (tool_parsers_xml.py has the details). A call is committed at the ``>`` of
  ``<function=NAME>``; its arguments are a JSON object built from the parameters (values typed by the
  tool's schema), sent one parameter at a time as each value ends, ``}`` when the function ends; a call
  cut short is closed with the parameters that ended. A ``<tool_call>`` holding JSON is read as hermes.
- ``harmony`` (gpt-oss; harmony.py has the details): messages ``<|channel|>NAME [to=RECIPIENT]
  [<|constrain|>json]<|message|>BODY<|end|>`` (or ``<|call|>`` / ``<|return|>``), later ones after
  ``<|start|>assistant``. A message to ``functions.NAME`` (a known name) whose body is a JSON object is a
  call, committed at its ``{``, its arguments streaming as written up to the matching ``}`` (cut at the next
  marker); ``final`` and ``commentary`` bodies (any message that is neither a call nor analysis, also one
  to an unknown function) are content; ``analysis`` bodies are dropped (the harmony reasoning parser,
  reasoning.py, makes them ``reasoning_content`` before they reach this stream). Unlike the other formats,
  no marker or header is ever content: they are special tokens, not the model's text.
- ``tool_choice: "required"``: the grammar-constrained output is a JSON array of ``{"name", "arguments"}``
  objects, streamed as ``mistral``'s array; named: the output is the function's arguments object, so the
  header is sent at its first ``{`` and the whole object streams as the arguments. An output not of that
  shape is content; once a call was sent, it stays (cut short: with what was written) and what follows the
  calls is content.

``keeps_special_tokens(parser)`` says whether the format's marker is a special token that the
detokenizer must keep for the parser to see it (Mistral's ``[TOOL_CALLS]`` / ``[ARGS]``, harmony's markers).
"""

from __future__ import annotations

import ast
import json
import re
import uuid

from .harmony import HarmonyCalls
from .tool_parsers_xml import Qwen3XmlCalls
from .tool_plan import ToolPlan

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "harmony")

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG, _PYTHON_START = "<|python_tag|>", "<|python_start|>"
_MISTRAL, _MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_MAX_STRING = 256          # characters of a key or name string (quotes, escapes) read before giving up
_MAX_NAME = 64             # tools.py's bound on function names
_WS = re.compile(r"\s*")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.-]*")
_SCALAR = re.compile(r"[\w.+-]*")
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_JSON_NAMES = {"true": True, "false": False, "null": None}
_MORE, _BAD = object(), object()   # _read_string: wait for text / not a string to read
# which parser each chat template asks for: the first one with a hint whose strings its source all
# contains (else hermes). Qwen3-Coder's template also has "<tool_call>": qwen3_xml comes before hermes.
_TEMPLATE_HINTS = (("harmony", (("<|channel|>",),)),
                   ("qwen3_xml", (("<function=", "<parameter="),)),
                   ("pythonic", (("[func_name1(",), ("func_name1(params_name1=",), ("[func_name(",))),
                   ("mistral", (("[TOOL_CALLS]",),)),
                   ("hermes", (("<tool_call>",),)),
                   ("llama3_json", (("<|python_tag|>",), ("dictionary of argument name and its value",))))


def detect_tool_call_parser(chat_template: str | None) -> str:
    """The parser the chat template's source asks for: its call marker or its instructions (gpt-oss'
    harmony ``<|channel|>``, Qwen3-Coder's ``<function=`` with ``<parameter=``, Llama 3.2 / 4's pythonic
    ``[func_name1(params_name1=params_value1, ...)]``, Mistral's ``[TOOL_CALLS]``, Qwen / Hermes'
    ``<tool_call>``, Llama 3.1's ``<|python_tag|>`` and JSON instructions); ``"hermes"`` when none matches,
    the form tools.py's own system prompt asks for."""
    source = chat_template or ""
    return next((parser for parser, hints in _TEMPLATE_HINTS
                 if any(all(part in source for part in hint) for hint in hints)), "hermes")


def keeps_special_tokens(parser: str) -> bool:
    """Whether the detokenizer must keep special tokens for ``parser`` to see its marker. hermes: no
    (``<tool_call>`` is an ordinary added token in Qwen's vocabularies, and plain text otherwise);
    llama3_json: no (``<|python_tag|>`` is special and skipped: the JSON object then starts the output,
    which is read all the same); pythonic: no (plain text; Llama 4's ``<|python_start|>`` is skipped and the
    list starts the output); mistral: yes (``[TOOL_CALLS]`` and ``[ARGS]`` are control tokens: without them the
    ``name[ARGS]{...}`` form cannot be read, only an array at the start of the output); qwen3_xml: no
    (``<tool_call>`` as for hermes; the tags inside are plain text); harmony: yes (``<|channel|>``,
    ``<|message|>``, ``<|call|>`` ... are special tokens that delimit every message)."""
    return parser in ("mistral", "harmony")


class _Scan:
    """Where a bracketed value (or a string) ends, read piece by piece: string-aware depth of brackets, any
    kind counting alike (malformed nesting is the model's; the scan just has to end). ``stop`` characters
    outside strings end the value early (a hermes block's ``<``)."""

    _INSIDE = {q: re.compile(r"[\\" + q + "]") for q in "\"'"}
    _OUTSIDE: dict[tuple[str, str, str], re.Pattern] = {}

    def __init__(self, quotes: str = '"', brackets: str = "[]{}", stop: str = "", depth: int = 0) -> None:
        self.depth, self.quote, self._escape = depth, None, False
        self._quotes, self._opening = quotes, brackets[0::2]
        key = (quotes, brackets, stop)
        if key not in self._OUTSIDE:
            self._OUTSIDE[key] = re.compile("[" + re.escape(quotes + brackets + stop) + "]")
        self._outside, self._stop = self._OUTSIDE[key], stop

    def advance(self, text: str, i: int, end: int | None = None) -> tuple[int, bool]:
        """(where reading stopped, whether the value ended there), reading ``text[i:end]``."""
        n = len(text) if end is None else end
        while i < n:
            if self.quote is not None:
                if self._escape:
                    self._escape, i = False, i + 1
                    continue
                m = self._INSIDE[self.quote].search(text, i, n)
                if m is None:
                    return n, False
                i = m.end()
                if m.group() == "\\":
                    self._escape = True
                else:
                    self.quote = None
                    if self.depth <= 0:
                        return i, True
                continue
            m = self._outside.search(text, i, n)
            if m is None:
                return n, False
            c, i = m.group(), m.end()
            if c in self._stop:
                return m.start(), True
            if c in self._quotes:
                self.quote = c
            elif c in self._opening:
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return i, True
        return n, False


def _literal(node):
    """The JSON value of a Python literal's syntax tree (JSON's true / false / null accepted); ValueError."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("a key that is not a string")
        return dict(zip(keys, (_literal(value) for value in node.values)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    raise ValueError("not a literal")


def _python_arguments(parenthesized: str) -> str | None:
    """The JSON object text of a pythonic call's ``(key=literal, ...)``, or None (positional arguments,
    ``**`` spreads, anything but literals, non-finite numbers, nesting Python cannot parse)."""
    try:
        call = ast.parse("f" + parenthesized, mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(kw.arg is None for kw in call.keywords):
            return None
        return json.dumps({kw.arg: _literal(kw.value) for kw in call.keywords}, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def merge_tool_deltas(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """(content, calls) of a choice's deltas, merged as the openai client's accumulator does: content
    concatenated (None when empty); calls by index, id and name from the first delta, arguments
    concatenated; each call ``{"id", "type": "function", "function": {"name", "arguments"}}``."""
    content, calls = [], {}
    for delta in deltas:
        content.append(delta.get("content") or "")
        for entry in delta.get("tool_calls", ()):
            call = calls.setdefault(entry["index"], {"id": entry.get("id"), "type": "function",
                                                     "function": {"name": entry["function"].get("name"),
                                                                  "arguments": ""}})
            call["function"]["arguments"] += entry["function"].get("arguments") or ""
    return "".join(content) or None, [calls[i] for i in sorted(calls)]


class ToolCallStream(Qwen3XmlCalls, HarmonyCalls):
    """One choice's tool calls, parsed as its text arrives (see the module docstring for the contract).

    A state machine over ``_text`` (the undecided tail of the output): ``_state`` is the method reading at
    ``_pos``; it returns True when it moved on, False when it needs more text. ``_start`` is where the
    candidate call being read began (None once committed, or when there is none): a candidate that fails
    is released as content up to where it failed. Invariant: every state decides only on text it has, so
    a decision never depends on how the text was split. The qwen3_xml and harmony states are the mixins'
    (tool_parsers_xml.py, harmony.py); the states in ``_HOLDS_MARK`` keep the text from ``_mark`` on."""

    _HOLDS_MARK = frozenset({"_arguments", "_py_call"}) | Qwen3XmlCalls.XML_HOLDS_MARK | HarmonyCalls.HARMONY_HOLDS_MARK

    def __init__(self, plan: ToolPlan, parser: str = "hermes") -> None:
        if parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool call parser {parser!r} (one of {', '.join(TOOL_CALL_PARSERS)})")
        self.made_calls = False
        self._plan, self._names = plan, plan.names
        self._text, self._pos, self._start = "", 0, None
        self._sep = self._mark = 0           # _separator: where the call ended; _arguments / _py_call: see there
        self._state = self._content
        self._fresh = True                   # only whitespace so far: the start rules below may apply
        self._pending: list[str] = []       # trailing content whitespace, held (see _content_text)
        self._sent_content = False
        self._out: list[list] = []           # [kind, index, pieces] runs, merged into deltas by _deltas
        self._index = 0                      # calls sent
        self._emit = True                    # whether the current call is sent (parallel false: the first)
        self._seq = ""                       # block | objects | array | pythonic | single: what follows a call
        self._name = self._key = self._args = None
        self._has_args = False
        self._scan: _Scan | None = None
        self._xml_args: int | None = None    # qwen3_xml: parameters sent of the open call (None: none open)
        self._h_content = True               # harmony: whether the body being read is content
        if plan.choice == "named":
            self._marker, self._start_rule = None, ("{", self._begin_named)
        elif plan.choice == "required":
            self._marker, self._start_rule = None, ("[", self._begin("array", self._open_array))
        else:
            self._marker, self._start_rule = {
                "hermes": ((_OPEN, self._begin("block", self._open_object)),
                           ("{", self._begin("objects", self._open_object))),
                "llama3_json": ((_PYTHON_TAG, self._begin("objects", self._open_object)),
                                ("{", self._begin("objects", self._open_object))),
                "mistral": ((_MISTRAL, self._begin("mistral", self._mistral)),
                            ("[", self._begin("array", self._open_array))),
                "pythonic": ((_PYTHON_START, self._begin("pythonic", self._open_array)),
                             ("[", self._begin("pythonic", self._open_array))),
                "qwen3_xml": ((_OPEN, self._begin("xml", self._xml_open)),
                              ("<", self._begin("xml", self._xml_function))),
                "harmony": (None, None),
            }[parser]
            if parser == "harmony":          # its own reading from the start: no marker to look for
                self._seq, self._state = "harmony", self._h_lead

    # ------------------------------------------------------------------ public
    def feed(self, text: str) -> list[dict]:
        """The deltas that ``text`` (the next piece of the choice's output) settles."""
        self._text += text
        while self._state():
            pass
        self._trim()
        return self._deltas()

    def finish(self) -> list[dict]:
        """The deltas of whatever is still held at the end of the choice: a marker's prefix and a candidate
        call are content; a committed call ends where the text does; trailing whitespace goes by the rule."""
        while self._state():
            pass
        if self._state == self._content:
            self._content_text(self._text[self._pos:])
        elif self._start is not None:
            self._fail(len(self._text))
        elif self._seq == "harmony":
            self._h_finish()
        else:
            self._xml_finish()
        pending = "".join(self._pending)
        if pending and not self.made_calls:
            self._put("content", None, pending)
        self._text, self._pos, self._pending, self._state = "", 0, [], self._content
        return self._deltas()

    # ------------------------------------------------------------------ output
    def _deltas(self) -> list[dict]:
        out = []
        for kind, index, pieces in self._out:
            if kind == "content":
                out.append({"content": "".join(pieces)})
            elif kind == "call":
                out.append({"tool_calls": [{"index": index, "id": f"call_{uuid.uuid4().hex[:24]}",
                                            "type": "function", "function": {"name": pieces[0], "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": "".join(pieces)}}]})
        self._out = []
        return out

    def _put(self, kind: str, index: int | None, piece: str) -> None:
        last = self._out[-1] if self._out else None
        if kind != "call" and last is not None and last[0] == kind and last[1] == index:
            last[2].append(piece)
        else:
            self._out.append([kind, index, [piece]])

    def _content_text(self, text: str) -> None:
        """Send ``text`` as content, holding its trailing whitespace (see the stripping rule)."""
        body = text.rstrip()
        if not body:
            if text:
                self._pending.append(text)
            return
        body, self._pending = "".join(self._pending) + body, [text[len(body):]]
        if not self._sent_content and self.made_calls:
            body = body.lstrip()
        self._sent_content = True
        self._put("content", None, body)

    def _commit(self, name: str) -> None:
        self._start = None
        self._emit = self._plan.parallel or not self.made_calls
        self.made_calls = True
        if self._emit:
            self._put("call", self._index, name)
            self._index += 1

    def _arguments_text(self, piece: str) -> None:
        if piece and self._emit:
            self._put("arguments", self._index - 1, piece)

    def _fail(self, end: int) -> bool:
        """The candidate call is not one: its text up to ``end`` is content; reading resumes there."""
        self._content_text(self._text[self._start:end])
        self._start, self._pos, self._state = None, end, self._content
        return True

    def _trim(self) -> None:
        """Drop the text no state can come back to (it keeps feeding linear)."""
        keep = self._pos if self._start is None else min(self._pos, self._start)
        if self._state == self._separator:
            keep = min(keep, self._sep)
        elif self._state.__name__ in self._HOLDS_MARK:
            keep = min(keep, self._mark)
        if keep > 0:
            self._text = self._text[keep:]
            self._pos -= keep
            self._sep -= keep
            self._mark -= keep
            if self._start is not None:
                self._start -= keep

    # ------------------------------------------------------------------ reading helpers
    def _skip_ws(self) -> bool:
        """Skip whitespace; whether a character follows."""
        self._pos = _WS.match(self._text, self._pos).end()
        return self._pos < len(self._text)

    def _read_string(self):
        """The JSON string at ``_pos`` (moving past it), _MORE, or _BAD (over _MAX_STRING, bad escapes)."""
        text, pos = self._text, self._pos
        end = min(len(text), pos + _MAX_STRING)
        m = _JSON_STRING.match(text, pos, end)
        if m is None:
            return _MORE if end < pos + _MAX_STRING and end == len(text) else _BAD
        try:
            value = json.loads(m.group())
        except ValueError:
            return _BAD
        self._pos = m.end()
        return value

    def _goto(self, state) -> bool:
        self._state = state
        return True

    @staticmethod
    def _new_scan() -> _Scan:
        return _Scan()

    # ------------------------------------------------------------------ content and markers
    def _content(self) -> bool:
        text, pos = self._text, self._pos
        if pos >= len(text):
            return False
        if self._fresh:
            end = _WS.match(text, pos).end()
            self._content_text(text[pos:end])
            self._pos = pos = end
            marker = self._marker[0] if self._marker else ""
            if end == len(text) or len(text) - end < len(marker) and marker.startswith(text[end:]):
                return False                 # the marker comes first (Mistral's "[TOOL_CALLS]" is no array)
            self._fresh = False
            start_char, begin = self._start_rule
            if text[end] == start_char and not (marker and text.startswith(marker, end)):
                self._start = end
                return begin()
        if self._marker is None:
            self._content_text(text[pos:])
            self._pos = len(text)
            return False
        marker, begin = self._marker
        found = text.find(marker, pos)
        if found >= 0:
            self._content_text(text[pos:found])
            self._start, self._pos = found, found + len(marker)
            return begin()
        hold = next((k for k in range(min(len(marker) - 1, len(text) - pos), 0, -1)
                     if text.endswith(marker[:k])), 0)
        self._content_text(text[pos:len(text) - hold])
        self._pos = len(text) - hold
        return False

    def _begin(self, seq: str, state):
        def begin() -> bool:
            self._seq = seq
            return self._goto(state)
        return begin

    def _begin_named(self) -> bool:
        self._seq, self._name = "single", self._plan.name
        return self._goto(self._open_arguments)

    def _mistral(self) -> bool:
        """After ``[TOOL_CALLS]``: a JSON array of calls, or ``name[ARGS]{...}``."""
        if not self._skip_ws():
            return False
        text, pos = self._text, self._pos
        if text[pos] == "[":
            self._seq = "array"
            return self._goto(self._open_array)
        end = _NAME_CHARS.match(text, pos).end()
        if end - pos > _MAX_NAME:
            return self._fail(pos)
        tail = text[end:end + len(_MISTRAL_ARGS)]
        if len(tail) < len(_MISTRAL_ARGS) and _MISTRAL_ARGS.startswith(tail):
            return False
        if tail != _MISTRAL_ARGS or text[pos:end] not in self._names:
            return self._fail(pos)
        self._seq, self._name, self._pos = "single", text[pos:end], end + len(_MISTRAL_ARGS)
        return self._goto(self._open_arguments)

    # ------------------------------------------------------------------ JSON call objects
    def _open_array(self) -> bool:
        if not self._skip_ws():
            return False
        if self._text[self._pos] != "[":
            return self._fail(self._pos)
        self._pos += 1
        return self._goto(self._py_item if self._seq == "pythonic" else self._open_object)

    def _open_object(self) -> bool:
        if not self._skip_ws():
            return False
        if self._text[self._pos] != "{":
            return self._fail(self._pos)
        self._pos += 1
        self._name = self._args = None
        self._has_args = False
        return self._goto(self._key_state)

    def _key_state(self) -> bool:
        if not self._skip_ws():
            return False
        c = self._text[self._pos]
        if c == "}":
            return self._object_end()
        key = self._read_string() if c == '"' else _BAD
        if key is _MORE:
            return False
        if key is _BAD:
            return self._fail(self._pos)
        self._key = key
        return self._goto(self._colon)

    def _colon(self) -> bool:
        if not self._skip_ws():
            return False
        if self._text[self._pos] != ":":
            return self._fail(self._pos)
        self._pos += 1
        return self._goto(self._value)

    def _value(self) -> bool:
        if not self._skip_ws():
            return False
        pos, c = self._pos, self._text[self._pos]
        if self._key == "name" and self._name is None:
            name = self._read_string() if c == '"' else _BAD
            if name is _MORE:
                return False
            if name is _BAD or name not in self._names:
                return self._fail(pos)
            self._name = name
            if self._args is None:
                return self._goto(self._after_value)
            self._commit(name)
            self._arguments_text(self._args)
            return self._after_arguments()
        if self._key in ("arguments", "parameters") and not self._has_args:
            if c != "{":
                return self._fail(pos)
            self._has_args = True
            if self._name is not None:
                self._commit(self._name)
            self._scan, self._mark = _Scan(stop="<" if self._seq == "block" else ""), pos
            return self._goto(self._arguments)
        if c in '{["':
            self._scan = _Scan(stop="<" if self._seq == "block" else "")
            return self._goto(self._skip_value)
        end = _SCALAR.match(self._text, pos).end()
        if end == pos:
            return self._fail(pos)
        if end == len(self._text):
            return False
        self._pos = end
        return self._goto(self._after_value)

    def _skip_value(self) -> bool:
        self._pos, done = self._scan.advance(self._text, self._pos)
        return self._goto(self._after_value) if done else False

    def _after_value(self) -> bool:
        if not self._skip_ws():
            return False
        c = self._text[self._pos]
        if c == ",":
            self._pos += 1
            return self._goto(self._key_state)
        return self._object_end() if c == "}" else self._fail(self._pos)

    def _object_end(self) -> bool:
        """At the object's ``}`` before any commit: a known name without arguments is a call with ``{}``."""
        self._pos += 1
        if self._name is None or self._has_args:
            return self._fail(self._pos)
        self._commit(self._name)
        self._arguments_text("{}")
        return self._after_object()

    def _open_arguments(self) -> bool:
        """A named choice or Mistral's ``[ARGS]``: ``self._name``'s arguments object."""
        if not self._skip_ws():
            return False
        if self._text[self._pos] != "{":
            return self._fail(self._pos)
        self._commit(self._name)
        self._scan, self._mark = _Scan(), self._pos
        return self._goto(self._arguments)

    def _arguments(self) -> bool:
        """The arguments object from ``_mark``: streamed once committed (``_mark``: how far it was sent), else
        held until the name comes (``_mark``: where it began)."""
        text, read = self._text, self._pos
        end, marked = self._h_limit(read) if self._seq == "harmony" else (len(text), False)
        self._pos, done = self._scan.advance(text, read, end)
        done = done or marked and self._pos == end   # harmony: a marker ends the arguments
        if self._start is not None:          # before the name: keep it whole
            if not done:
                return False
            self._args = text[self._mark:self._pos].rstrip()
            return self._goto(self._after_value)
        if not done and self._scan.quote is None and (read == self._pos or text[read:self._pos].isspace()):
            return False                     # only more whitespace to hold (kept linear)
        piece = text[self._mark:self._pos]
        if done or self._scan.quote is None:
            piece = piece.rstrip()
        self._arguments_text(piece)
        self._mark += len(piece)
        return self._after_arguments() if done else False

    def _after_arguments(self) -> bool:
        """A committed call's arguments ended: read to the end of its call, as its format says."""
        if self._seq == "block":
            return self._goto(self._swallow)
        if self._seq == "single":
            return self._goto(self._content)
        if self._seq == "harmony":
            return self._goto(self._h_swallow)
        self._scan = _Scan(depth=1)
        return self._goto(self._rest)

    def _rest(self) -> bool:
        """The rest of a committed call's object (other keys, stray text) up to its closing brace."""
        self._pos, done = self._scan.advance(self._text, self._pos)
        return self._after_object() if done else False

    def _after_object(self) -> bool:
        if self._seq == "block":
            return self._goto(self._swallow)
        self._sep = self._pos
        return self._goto(self._separator)

    def _swallow(self) -> bool:
        """A committed hermes block: everything up to ``</tool_call>`` (or a next ``<tool_call>``) is its."""
        text, pos = self._text, self._pos
        close, reopen = text.find(_CLOSE, pos), text.find(_OPEN, pos)
        if close >= 0 and (reopen < 0 or close < reopen):
            self._pos = close + len(_CLOSE)
            return self._goto(self._content)
        if reopen >= 0:
            self._pos = reopen
            return self._goto(self._content)
        self._pos = max(pos, len(text) - len(_CLOSE) + 1)
        return False

    def _separator(self) -> bool:
        """After a call: the next one (``;`` for objects, ``,`` in lists), the list's end, or content."""
        if not self._skip_ws():
            return False
        c = self._text[self._pos]
        if c == (";" if self._seq == "objects" else ","):
            self._pos += 1
            self._start = self._pos
            return self._goto(self._py_item if self._seq == "pythonic" else self._open_object)
        if c == "]" and self._seq != "objects":
            self._pos += 1
        else:
            self._pos = self._sep            # the whitespace is content's, by the stripping rule
        return self._goto(self._content)

    # ------------------------------------------------------------------ pythonic calls
    def _py_item(self) -> bool:
        if not self._skip_ws():
            return False
        text, pos = self._text, self._pos
        end = _NAME_CHARS.match(text, pos).end()
        if end - pos > _MAX_NAME:
            return self._fail(pos)
        paren = _WS.match(text, end).end()
        if paren == len(text):
            return False
        if text[paren] != "(" or text[pos:end] not in self._names:
            return self._fail(pos)
        self._name, self._mark, self._pos = text[pos:end], paren, paren
        self._scan = _Scan(quotes="\"'", brackets="()[]{}")
        return self._goto(self._py_call)

    def _py_call(self) -> bool:
        """A pythonic call's parentheses (from ``_mark``), sent whole once they close."""
        self._pos, done = self._scan.advance(self._text, self._pos)
        if not done:
            return False
        arguments = _python_arguments(self._text[self._mark:self._pos])
        if arguments is None:
            return self._fail(self._pos)
        self._commit(self._name)
        self._arguments_text(arguments)
        return self._after_object()
