"""The public request bodies (OpenAI's), validated with pydantic at the HTTP edge only."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # Unknown fields are kept aside and ignored (logged by the server), as vLLM's server does, so
    # that clients sending newer or vendor-specific fields keep working. Known fields that would
    # change the output and are not implemented are refused instead (unsupported_option).
    # allow_inf_nan: Python's JSON parser takes Infinity and NaN, which no engine parameter may be.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the engine's seeds are 64-bit
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logprobs: Any = None
    user: str | None = None
    # vLLM extensions that operators rely on.
    # The engine's own limits (vLLM SamplingParams): refused here with a 400, not by a worker.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    logit_bias: dict[str, float] | None = None
    # Known options this server does not implement. They are named here so that a request
    # using one is refused (see unsupported_option), not silently served without it.
    best_of: int | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    prompt_logprobs: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[Any] | None = None
    guided_grammar: str | None = None
    structured_outputs: Any = None

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return value

    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    def unsupported_option(self) -> tuple[str, str] | None:
        """(field, message) of the first option set in this request that the server would
        otherwise ignore; None when there is none."""
        not_off = (None, False, 0, "none")
        logprobs, tools = "logprobs are not supported by this server yet", "tool calling is not supported by this server"
        checks = (
            ("n", self.n != 1, "only n=1 is supported"),
            ("best_of", self.best_of not in (None, 1), "only best_of=1 is supported"),
            ("logprobs", self.logprobs not in not_off, logprobs),
            ("top_logprobs", self.top_logprobs not in not_off, logprobs),
            ("prompt_logprobs", self.prompt_logprobs not in not_off, logprobs),
            ("tools", bool(self.tools), tools),
            ("functions", bool(self.functions), tools),
            ("tool_choice", self.tool_choice not in not_off, tools),
            ("function_call", self.function_call not in not_off, tools),
            ("response_format", bool(self.response_format) and self.response_format.get("type") != "text",
             'only response_format {"type": "text"} is supported'),
            *((name, getattr(self, name) is not None, f"`{name}` (guided decoding) is not supported by this server")
              for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")),
        )
        return next(((name, message) for name, used, message in checks if used), None)

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text":
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only)")
            parts.append(str(part.get("text", "")))
        return "".join(parts)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
