"""Tool calls out of generated text, in each family's format (vLLM's --tool-call-parser names,
docs/api.md#tool-calling) or as the JSON a forced call's grammar makes. One incremental parser
serves streamed and whole texts, so a stream's calls are the whole text's; a malformed call
(one nested past CALL_LIMITS included) leaves the output as content, as vLLM's parsers do."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Any

from kvfleet.protocol.json_body import JsonLimits, RequestRefused, decode_json_text
from kvfleet.protocol.tool_prompt import HERMES, LLAMA3_JSON, MISTRAL

_WS = " \t\r\n"
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits
_ARGUMENT_KEYS = ("arguments", "parameters")
# The nesting a call's arguments may have: a request body's.
CALL_LIMITS = JsonLimits(max_depth=64)


# What may follow a call's object, per mode.
_AFTER_CALL = {
    HERMES: "close",
    MISTRAL: "array_next",
    "array": "array_next",
    LLAMA3_JSON: "llama_next",
    "named": "trailing",
}


def tool_call_id(family: str | None, taken: Container[str] = ()) -> str:
    """A new call id, none of taken. Mistral's templates (and vLLM's mistral parser) refuse any
    id but 9 letters and digits when the call comes back in the conversation; the other
    families get OpenAI's ``call_`` form."""
    while True:
        if family == MISTRAL:
            call_id = "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))
        else:
            call_id = f"call_{uuid.uuid4().hex[:24]}"
        if call_id not in taken:
            return call_id


@dataclass
class ToolCallDelta:
    """A piece of one streamed call: the first carries id and name (arguments ""), the others
    argument text."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str


class _ObjectScanner:
    """Scans one JSON object as its text arrives: where each top-level value starts and ends.
    Checks only the structure it needs; the values themselves are decoded by json."""

    def __init__(self) -> None:
        # The text taken, in the pieces fed: joined only when read whole, so that streaming a
        # long call costs each piece, not the whole text so far, again and again.
        self._pieces: list[str] = []
        self.length = 0
        self.start: int | None = None  # where the object's "{" is
        self.stage = "open"  # open, key, key_str, colon, value_start, value, after_value, done
        self.values: dict[str, list[int | None]] = {}  # key -> [start, end or None]
        self.error = False
        self._key_start = 0
        self._key = ""
        self._depth = 0
        self._in_str = False
        self._escape = False

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def slice(self, start: int, stop: int) -> str:
        """text[start:stop], without joining the text when it lies in the last piece."""
        last = self._pieces[-1] if self._pieces else ""
        base = self.length - len(last)
        if start >= base:
            return last[start - base : stop - base]
        return self.text[start:stop]

    def feed(self, chunk: str) -> int:
        """Consume chunk up to the object's end; returns how many characters were used."""
        base = self.length
        self._pieces.append(chunk)
        self.length += len(chunk)
        for used, char in enumerate(chunk):
            if self.stage == "done" or self.error:
                self._pieces = [self.text[: base + used]]
                self.length = base + used
                return used
            self._step(char, base + used)
        return len(chunk)

    def _step(self, ch: str, i: int) -> None:
        stage = self.stage
        if stage == "value":
            self._value_char(ch, i)
        elif stage == "key_str":
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                try:
                    self._key = json.loads(self.slice(self._key_start, i + 1))
                except ValueError:
                    self.error = True
                self.stage = "colon"
        elif ch in _WS:
            return
        elif stage == "open":
            self.start = i
            self._expect(ch == "{", "key")
        elif stage == "key":
            if ch == "}" and not self.values:
                self.stage = "done"
            else:
                self._key_start = i
                self._expect(ch == '"', "key_str")
        elif stage == "colon":
            self._expect(ch == ":", "value_start")
        elif stage == "value_start":
            self.values[self._key] = [i, None]
            self.stage = "value"
            self._value_char(ch, i)
        elif stage == "after_value":
            self._after_value(ch)

    def _expect(self, ok: bool, then: str) -> None:
        if ok:
            self.stage = then
        else:
            self.error = True

    def _after_value(self, ch: str) -> None:
        if ch == ",":
            self.stage = "key"
        elif ch == "}":
            self.stage = "done"
        else:
            self.error = True

    def _value_char(self, ch: str, i: int) -> None:
        if self._in_str:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._in_str = False
                if self._depth == 0:
                    self._end_value(i + 1)
            return
        if ch == '"':
            self._in_str = True
        elif ch in "{[":
            self._depth += 1
            if self._depth > CALL_LIMITS.max_depth:
                self.error = True
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                self._end_value(i + 1)
            elif self._depth < 0:  # a scalar value ends at the object's own brace
                self._depth = 0
                self._end_scalar(ch, i)
        elif ch == "," and self._depth == 0:
            self._end_scalar(ch, i)

    def _end_value(self, end: int) -> None:
        self.values[self._key][1] = end
        self.stage = "after_value"

    def _end_scalar(self, ch: str, i: int) -> None:
        start = self.values[self._key][0]
        assert start is not None
        self.values[self._key][1] = start + len(self.slice(start, i).rstrip(_WS))
        self.stage = "after_value"
        self._after_value(ch)

    def span(self, key: str) -> tuple[int, int | None] | None:
        value = self.values.get(key)
        return None if value is None else (value[0], value[1])  # type: ignore[return-value]


class _Call:
    """One call being scanned: sends its header once the name is known, then its arguments as
    they come (a JSON object streams character by character; an arguments string, which some
    models write, is decoded whole)."""

    def __init__(
        self, index: int, call_id: str, name: str | None = None, bare_arguments: bool = False
    ) -> None:
        self.index = index
        self.id = call_id
        self.name = name
        # bare_arguments: the text is the arguments object itself (a named function's output).
        self.bare = bare_arguments
        self.scanner = _ObjectScanner()
        self.header_sent = False
        self._named = name is not None  # the name's value was read (a string or not)
        self._sent: list[str] = []  # the argument text sent, piece by piece
        self._sent_to: int | None = None  # where the streamed argument text was sent up to
        self._settled = False  # all the argument text is sent
        self._streamed: bool | None = None  # the arguments are an object, streamed as it comes

    @property
    def arguments(self) -> str:
        if len(self._sent) > 1:
            self._sent = ["".join(self._sent)]
        return self._sent[0] if self._sent else ""

    @property
    def done(self) -> bool:
        return self.scanner.stage == "done" or self.scanner.error

    @property
    def valid(self) -> bool:
        if self.scanner.error or self.scanner.stage != "done" or not self.name:
            return False
        # An arguments string holds JSON text of any depth: bounded like the rest.
        try:
            arguments = decode_json_text(self.arguments or "{}", CALL_LIMITS, "the arguments")
        except RequestRefused:
            return False
        return isinstance(arguments, dict)

    def feed(self, chunk: str, out: list[ToolCallDelta]) -> int:
        used = self.scanner.feed(chunk)
        span = self.scanner.span("name")
        if not self._named and span is not None and span[1] is not None:
            self._named = True
            self.name = self._decoded("name", str)
        if self.name is not None and not self.header_sent:
            self.header_sent = True
            out.append(ToolCallDelta(self.index, "", self.id, self.name))
        if self.header_sent and not self._settled:
            piece = self._new_arguments()
            if piece:
                self._sent.append(piece)
                out.append(ToolCallDelta(self.index, piece))
        return used

    def _decoded(self, key: str, kind: type) -> Any:
        span = self.scanner.span(key)
        if span is None or span[1] is None:
            return None
        try:
            value = json.loads(self.scanner.slice(span[0], span[1]))
        except ValueError:
            self.scanner.error = True
            return None
        return value if isinstance(value, kind) else None

    def _new_arguments(self) -> str:
        """The argument text not sent yet: an object's as it comes; an arguments string's JSON
        text, or any other value as written (which then fails the check that arguments are an
        object), whole once complete; "{}" for a call without arguments."""
        scanner = self.scanner
        if self.bare:
            start, stop = scanner.start, None
            if start is None:
                return ""
        else:
            key = next((k for k in _ARGUMENT_KEYS if k in scanner.values), None)
            if key is None:
                self._settled = scanner.stage == "done"
                return "{}" if self._settled else ""
            start, stop = scanner.span(key)  # type: ignore[misc]
            if self._streamed is None:
                self._streamed = scanner.slice(start, start + 1) == "{"
            if not self._streamed:
                if stop is None:
                    return ""
                self._settled = True
                decoded = self._decoded(key, str)
                return decoded if decoded is not None else scanner.slice(start, stop)
        end = scanner.length if stop is None else stop
        piece = scanner.slice(start if self._sent_to is None else self._sent_to, end)
        self._sent_to = end
        self._settled = stop is not None
        return piece


@dataclass
class ParseResult:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)


class ToolCallParser:
    """An incremental parser of one choice's output. feed() each new piece of text; it returns
    the content to show and the call deltas to send, holding back text that may still turn out
    to start a call. finish() returns what is held that is content after all. parse() does both
    for a whole text.

    mode: a family (TOOL_CALL_PARSERS), or "array" (a JSON array of {name, arguments}: what the
    grammar of tool_choice required makes), or "named" (the arguments object of `name`).
    family: the server's parser family, whose ids the calls get (None: OpenAI's); call_ids: ids
    not to use again (those of the conversation and of the response's other choices), each new
    call's id added."""

    def __init__(
        self,
        mode: str,
        name: str | None = None,
        family: str | None = None,
        call_ids: set[str] | None = None,
    ) -> None:
        self.mode = mode
        self.name = name
        self.family = family
        self.call_ids = set() if call_ids is None else call_ids
        self.calls: list[_Call] = []
        self.malformed = False
        self._buf = ""
        self._content_sent = False
        self._tail_ws = ""  # whitespace after calls, shown only if content follows it
        self._state = {
            HERMES: "content",
            MISTRAL: "content",
            LLAMA3_JSON: "start",
            "array": "array_open",
            "named": "object",
        }[mode]
        if mode == "named":
            self.calls.append(_Call(0, self._new_id(), name, bare_arguments=True))

    @property
    def called(self) -> bool:
        """Whether a call has been sent (its header, at least)."""
        return any(c.header_sent for c in self.calls)

    @property
    def marker(self) -> str:
        return "<tool_call>" if self.mode == HERMES else "[TOOL_CALLS]"

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while self._buf and self._advance(content, deltas):
            pass
        return "".join(content), deltas

    def finish(self) -> str:
        """At the end of the output: held-back text is content after all; an unfinished call
        makes the output malformed."""
        if self._state not in ("content", "plain", "start", "llama_next", "trailing"):
            self.malformed = True
        if any(not c.valid for c in self.calls):
            self.malformed = True
        held = "" if self.malformed else self._buf
        self._buf = ""
        return held

    def parse(self, text: str, *, truncated: bool = False) -> ParseResult:
        """A whole output: its calls, or (as vLLM does) all of it as content when a call in it
        is malformed. truncated: the output was cut (max_tokens); a forced call's output (array,
        named) is then a prefix of what its grammar allows, and the calls it completed are
        calls, the one it was writing dropped."""
        content, _ = self.feed(text)
        rest = self.finish()
        if self.malformed and truncated and self.mode in ("array", "named"):
            done = [
                ParsedCall(c.id, c.name or "", c.arguments or "{}") for c in self.calls if c.valid
            ]
            if done:
                return ParseResult("", done)
        if self.malformed:
            return ParseResult(text)
        calls = [ParsedCall(c.id, c.name or "", c.arguments or "{}") for c in self.calls]
        return ParseResult(content + rest, calls)

    # -- states --------------------------------------------------------------------------
    def _advance(self, content: list[str], deltas: list[ToolCallDelta]) -> bool:
        """One step on the buffer; False when it needs more text."""
        state = self._state
        if state == "content":
            return self._content(content)
        if state == "plain":
            content.append(self._buf)
            self._buf = ""
            return False
        if state == "start":  # llama3_json: calls only at the very start
            return self._llama_start()
        if state == "object":
            call = self.calls[-1]
            used = call.feed(self._buf, deltas)
            self._buf = self._buf[used:]
            if call.scanner.error:
                self.malformed = True
                self._state = "plain"
                return True
            if call.done:
                self._state = _AFTER_CALL[self.mode]
                return True
            return False
        self._buf = self._buf.lstrip(_WS)
        if not self._buf:
            return False
        return self._between(state)

    def _between(self, state: str) -> bool:
        """The separators and brackets around calls (the buffer starts with no whitespace)."""
        head = self._buf[0]
        if state == "close":  # hermes: </tool_call>
            end = "</tool_call>"
            if self._buf.startswith(end):
                self._buf = self._buf[len(end) :]
                self._state = "content"
                return True
            return False if end.startswith(self._buf) else self._malformed()
        if state == "open":  # after <tool_call>
            return self._open_object() if head == "{" else self._malformed()
        if state == "array_open":
            if head != "[":
                return self._malformed()
            self._buf = self._buf[1:]
            self._state = "array_item"
            return True
        if state == "array_item":
            return self._open_object() if head == "{" else self._malformed()
        if state == "array_next":
            self._buf = self._buf[1:]
            if head == ",":
                self._state = "array_item"
            elif head == "]":
                self._state = "trailing"
            else:
                return self._malformed()
            return True
        if state == "llama_next":
            if head != ";":
                return self._malformed()
            self._buf = self._buf[1:]
            self._state = "llama_item"
            return True
        if state == "llama_item":
            return self._open_object() if head == "{" else self._malformed()
        # trailing: after a closed array or a named call's object, nothing more is a call
        self._state = "plain"
        return True

    def _open_object(self) -> bool:
        self.calls.append(_Call(len(self.calls), self._new_id()))
        self._state = "object"
        return True

    def _new_id(self) -> str:
        call_id = tool_call_id(self.family, self.call_ids)
        self.call_ids.add(call_id)
        return call_id

    def _malformed(self) -> bool:
        self.malformed = True
        self._state = "plain"
        return True

    def _content(self, content: list[str]) -> bool:
        marker = self.marker
        at = self._buf.find(marker)
        if at >= 0:
            self._show(self._buf[:at], content)
            self._buf = self._buf[at + len(marker) :]
            self._state = "open" if self.mode == HERMES else "array_open"
            return True
        # Hold back a suffix that may be the start of the marker.
        keep = next(
            (k for k in range(min(len(marker) - 1, len(self._buf)), 0, -1)
             if marker.startswith(self._buf[-k:])),
            0,
        )  # fmt: skip
        self._show(self._buf[: len(self._buf) - keep], content)
        self._buf = self._buf[len(self._buf) - keep :]
        return False

    def _show(self, text: str, content: list[str]) -> None:
        """Content; between and after calls, whitespace alone is layout, not content."""
        if not self.calls:
            content.append(text)
            return
        text = self._tail_ws + text
        if text.strip(_WS):
            content.append(text)
            self._tail_ws = ""
        else:
            self._tail_ws = text

    def _llama_start(self) -> bool:
        stripped = self._buf.lstrip(_WS)
        tag = "<|python_tag|>"
        if not stripped or (tag.startswith(stripped) and stripped != tag):
            return False
        if stripped.startswith(tag):
            self._buf = stripped[len(tag) :]
            self._state = "llama_item"
            return True
        if stripped.startswith("{"):
            self._buf = stripped
            self._state = "llama_item"
            return True
        self._state = "plain"
        return True
