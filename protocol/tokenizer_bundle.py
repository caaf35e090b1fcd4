"""The wire format of an engine's tokenizer (``GET /tokenizer``): the files Hugging Face's
``save_pretrained`` writes for the tokenizer the engine loaded (tokenizer.json, its config with
the chat template, the special tokens), as one JSON object ``{"files": {name: text}}``, with the
engine's tool-call parser family (``tool_call_parser``: the format a template that reads no tools
gets a request's tools in, kvfleet.protocol.tool_prompt). A router without a tokenizer of its own
fetches it, so that it tokenizes prompts exactly as the engines do.

The bundle is semi-trusted input to the router: its size, its number of files and their names
are bounded here, and a name is a plain file name (no folder, no dot file), so writing the files
into a folder of the router's own can put nothing elsewhere.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, StringConstraints, field_validator

from kvfleet.protocol.tool_prompt import TOOL_CALL_PARSERS

PATH = "/tokenizer"
# The largest tokenizers in use (Gemma's tokenizer.json: about 34 MB) fit with room.
MAX_BUNDLE_BYTES = 64 * 1024 * 1024
MAX_FILES = 16

FileName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")]


class TokenizerBundle(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    files: dict[FileName, str]
    tool_call_parser: Literal[TOOL_CALL_PARSERS] | None = None  # type: ignore[valid-type]

    @field_validator("files")
    @classmethod
    def _bounded(cls, files: dict[str, str]) -> dict[str, str]:
        if not 0 < len(files) <= MAX_FILES:
            raise ValueError(f"a tokenizer of 1 to {MAX_FILES} files, not {len(files)}")
        if "tokenizer.json" not in files:
            raise ValueError("no tokenizer.json: only fast tokenizers are served")
        return files
