"""The public request bodies (OpenAI's), validated with pydantic at the HTTP edge only."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, ClassVar, Literal, get_args

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo

from mooncake.defaults import MAX_LOGPROBS, MAX_SAMPLES

UNTRUSTED_TEMPLATE = ("a chat template sent with the request is not run by this server (as vLLM without "
                      "--trust-request-chat-template); the model's own template is used without it, and "
                      "chat_template_kwargs pass variables to it")

# The structured-output kinds (mooncake/protocol.py Sampling.structured), by their request names.
STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The dotted path of the first string in `value` (JSON: dicts, lists, strings) that is not
    encodable as UTF-8, or None."""
    try:
        msgspec.json.encode(value)  # C speed: a long prompt of token ids is mostly ints
        return None
    except UnicodeEncodeError:
        pass
    except (TypeError, ValueError):  # not JSON-shaped: the model's own validation says why
        return None
    if isinstance(value, str):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        shown = str(key).encode("utf-8", "backslashreplace").decode()  # the path goes into an error's JSON
        key_path = f"{path}.{shown}" if path else shown
        if isinstance(key, str) and lone_surrogate_at(key) is not None:
            return key_path
        found = lone_surrogate_at(item, key_path)
        if found is not None:
            return found
    return None


def _allows_none(field: FieldInfo) -> bool:
    annotation = field.annotation
    return annotation is Any or annotation is type(None) or type(None) in get_args(annotation)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far on every chunk too


class MooncakeSLO(BaseModel):
    """This request's own SLOs (conductor/slo.py), within the server's bounds."""
    model_config = ConfigDict(extra="forbid")

    ttft_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)
    tbt_ms: float | None = Field(None, gt=0.0, allow_inf_nan=False)


FLOAT32_ROUNDS_TO_ZERO = 2.0**-150
"""Half the smallest positive float32 (2**-149): a positive value at or below it rounds to 0."""


class _SamplingFields(BaseModel):
    # Unknown fields are kept aside and ignored (logged by the server), as vLLM's server does, so
    # that clients sending newer or vendor-specific fields keep working. Known fields that would
    # change the output and are not implemented are refused instead (unsupported_option).
    # allow_inf_nan: Python's JSON parser takes Infinity and NaN, which no engine parameter may be.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    TOOLS_IN_PROMPT: ClassVar[bool] = False  # chat: tools with tool_choice "none" go to the chat template

    model: str
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_SAMPLES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # the engine's seeds are 64-bit
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    user: str | None = None
    # vLLM extensions that operators rely on.
    # The engine's own limits (vLLM SamplingParams): refused here with a 400, not by a worker.
    top_k: int | None = Field(None, ge=-1, le=2**63 - 1)  # past int64 the engine fails the request
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    min_tokens: int = Field(0, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs, and vLLM's older
    # guided_* names for the same constraints.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    priority: int | None = None  # lower is more important; the SLO class's when None (conductor/slo.py)
    mooncake_slo: MooncakeSLO | None = None
    # Known options this server does not implement. They are named here so that a request
    # using one is refused (see unsupported_option), not silently served without it.
    best_of: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[Any] | None = None
    bad_words: list[Any] | None = None
    truncate_prompt_tokens: int | None = None
    logits_processors: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM's fields that change the answer (beam search, logprob shapes, the chat template's
    # reasoning switch and documents, ...): refused when set, not served as if absent.
    use_beam_search: bool | None = None
    length_penalty: float | None = None
    return_tokens_as_token_ids: bool | None = None
    logprob_token_ids: Any = None
    reasoning_effort: Any = None
    documents: Any = None
    thinking_token_budget: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    truncation_side: Any = None
    return_token_ids: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls_mean_defaults(cls, data: Any) -> Any:
        # OpenAI's spec types stream, n, the penalties, echo... as "X or null", and clients send
        # null for "not set": the default, not a 400 for a field that holds no None.
        if isinstance(data, dict) and None in data.values():
            strict = {name for name, f in cls.model_fields.items() if not f.is_required() and not _allows_none(f)}
            data = {k: v for k, v in data.items() if v is not None or k not in strict}
        return data

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        # JSON may spell a lone UTF-16 surrogate ("\ud800"), which no UTF-8 text holds: the
        # tokenizer and the wire to the workers would fail on it later, as a 500.
        where = lone_surrogate_at(data)
        if where is not None:
            raise ValueError(f"{where or 'the body'} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                             f"valid Unicode text")
        return data

    @field_validator("stream_options", mode="before")
    @classmethod
    def _stream_options_need_stream(cls, value: Any, info: ValidationInfo) -> Any:
        # As vLLM and OpenAI: options for a stream on a request that will not stream are a mistake.
        if value and not info.data.get("stream"):
            raise ValueError("stream_options can only be set when stream is true")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        if value is None:
            return None
        stops = [value] if isinstance(value, str) else value
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return stops

    @field_validator("repetition_penalty")
    @classmethod
    def _penalty_not_zero_in_float32(cls, value: float | None) -> float | None:
        # The engine applies the penalty in float32, where a value this small is 0: masked logits
        # (-inf, a structured output's) times 0 are NaN, and vLLM samples a token its own grammar
        # then rejects (a 500). For the engine this is the 0 that its own check refuses.
        if value is not None and value <= FLOAT32_ROUNDS_TO_ZERO:
            raise ValueError(f"must be greater than 0 in float32, the engine's precision; {value!r} is 0 there")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not re.fullmatch(r"-?[0-9]+", key):  # ASCII digits: str.isdigit takes "²", int() does not
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
        tools = "tool calling is not supported by this server"
        checks = (
            ("best_of", self.best_of not in (None, 1), "best_of is not supported; use n for several samples"),
            ("prompt_logprobs", self.prompt_logprobs is not None and self.stream,
             "prompt_logprobs are not available when stream=True"),
            *((name, getattr(self, name) not in (None, default), f"{name} is not supported by this server")
              for name, default in (("include_stop_str_in_output", False), ("skip_special_tokens", True),
                                    ("spaces_between_special_tokens", True), ("allowed_token_ids", None),
                                    ("bad_words", None), ("truncate_prompt_tokens", None),
                                    ("logits_processors", None), ("use_beam_search", False),
                                    ("length_penalty", 1.0), ("return_tokens_as_token_ids", False),
                                    ("logprob_token_ids", None), ("reasoning_effort", None), ("documents", None),
                                    ("thinking_token_budget", None), ("repetition_detection", None),
                                    ("watermarking", None), ("truncation_side", None),
                                    ("return_token_ids", False))),
            # tool_choice "none": the tools only go into the prompt (the chat template's), as vLLM does.
            ("tools", bool(self.tools) and not (self.TOOLS_IN_PROMPT and self.tool_choice == "none"),
             tools + (" (tool_choice \"none\" is)" if self.TOOLS_IN_PROMPT else "")),
            ("functions", bool(self.functions), tools),
            ("tool_choice", self.tool_choice not in not_off, tools),
            ("function_call", self.function_call not in not_off, tools),
            *self._own_unsupported(),
        )
        return next(((name, message) for name, used, message in checks if used), None)

    def _own_unsupported(self) -> tuple[tuple[str, bool, str], ...]:
        return ()

    def structured(self) -> tuple[str, str] | None:
        """The structured-output constraint (kind, spec) this request asks for, or None.
        Raises ValueError (naming the field first) for a malformed or doubled one."""
        found: list[tuple[str, str, Any]] = []  # (field, kind, value)
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                found.append(("response_format", "json_object", True))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise ValueError("response_format: json_schema.schema must be a JSON schema object")
                found.append(("response_format", "json", schema))
            elif kind != "text":
                raise ValueError(f"response_format: type must be text, json_object or json_schema, got {kind!r}")
        for kind in STRUCTURED_KINDS[:4]:
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                found.append((f"guided_{kind}", kind, value))
        for kind, value in (self.structured_outputs or {}).items():
            if kind not in STRUCTURED_KINDS:
                raise ValueError(f"structured_outputs: {kind!r} is not supported (use one of {', '.join(STRUCTURED_KINDS)})")
            if value not in (None, False):
                found.append(("structured_outputs", kind, value))
        if not found:
            return None
        if len(found) > 1:
            raise ValueError(f"{found[1][0]}: only one structured-output constraint may be given")
        field_name, kind, value = found[0]
        if kind == "json_object":
            return kind, ""
        if kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"{field_name}: the JSON schema is not valid JSON: {exc}") from None
        if kind == "json" and not isinstance(value, dict):
            raise ValueError(f"{field_name}: the JSON schema must be a JSON object")
        if kind == "choice" and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise ValueError(f"{field_name}: choice must be a non-empty list of strings")
        if kind in ("regex", "grammar") and not isinstance(value, str):
            raise ValueError(f"{field_name}: {kind} must be a string")
        return kind, value if isinstance(value, str) else json.dumps(value)

    def stop_strings(self) -> list[str]:
        return list(self.stop or [])  # type: ignore[arg-type]


COMPLETION_DEFAULT_MAX_TOKENS = 16
"""max_tokens of a completion that does not set it, or sets it to null (OpenAI's and vLLM's)."""


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    add_special_tokens: bool = True  # the tokenizer's (a BOS, for models that have one); vLLM's default
    max_tokens: int | None = Field(COMPLETION_DEFAULT_MAX_TOKENS, ge=0)  # 0: with echo, the prompt alone
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top logprobs per token
    top_logprobs: int | None = None  # chat's name; refused here

    def _own_unsupported(self) -> tuple[tuple[str, bool, str], ...]:
        return (("suffix", bool(self.suffix), "suffix (insertion) is not supported by this server"),
                ("top_logprobs", self.top_logprobs is not None,
                 "top_logprobs is a chat parameter; /v1/completions takes logprobs=N"))

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one unless a list of strings or of token-id lists batches several."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        return [p]

    def logprobs_top(self) -> int | None:
        return self.logprobs

    def prompt_logprobs_top(self) -> int | None:
        # As vLLM: echoing the prompt with logprobs asks for the prompt's logprobs too.
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs


TEMPLATE_MESSAGE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning_content")
"""A chat message's fields besides role and content that reach the chat template, as in vLLM."""

TEXT_PART_KEYS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal",
                  "thinking": "thinking"}
"""Content part types that are text, and the key that holds it (vLLM's TEXT_PART_TYPES)."""


def template_tool_calls(tool_calls: Any) -> Any:
    """An assistant message's tool calls as chat templates expect them (vLLM's
    _postprocess_messages): each call's JSON `arguments` string parsed into an object; none,
    empty, not JSON or not an object becomes {} (it is history: refusing it would refuse every
    later turn of the conversation). None for an empty list: the template's plain path."""
    if not isinstance(tool_calls, list):
        return tool_calls
    calls = []
    for item in tool_calls:
        function = item.get("function") if isinstance(item, dict) else None
        if not isinstance(function, dict) or item.get("type", "function") != "function":
            raise ValueError("an assistant message's tool_calls must be objects of type 'function' with a "
                             "'function' object")
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            try:
                arguments = json.loads(arguments)
            except ValueError:
                arguments = None
        calls.append({**item, "function": {**function, "arguments": arguments if isinstance(arguments, dict) else {}}})
    return calls or None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            key = TEXT_PART_KEYS.get(part.get("type"))
            if key is None:
                raise ValueError(f"content part of type {part.get('type')!r} is not supported (text only: "
                                 f"{', '.join(TEXT_PART_KEYS)})")
            parts.append(str(part.get(key) or ""))
        return "\n".join(parts)  # as vLLM renders several text parts of one message

    def for_template(self) -> dict[str, Any]:
        """The message as the chat template sees it: role and text, and the fields of a
        conversation with tools and names that vLLM passes on too (a tool call in the history,
        the id a tool's answer refers to, a speaker's name)."""
        rendered: dict[str, Any] = {"role": self.role, "content": self.text()}
        extra = self.model_extra or {}
        for name in TEMPLATE_MESSAGE_FIELDS:
            if extra.get(name) is not None:
                rendered[name] = extra[name]
        if self.role == "assistant" and "tool_calls" in rendered:
            calls = template_tool_calls(rendered.pop("tool_calls"))
            if calls is not None:
                rendered["tool_calls"] = calls
        return rendered


class ChatTemplateFields(BaseModel):
    """How chat messages become the prompt, vLLM's names and defaults (conductor/prompts.py)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    add_special_tokens: bool = False  # on top of the template's own
    chat_template_kwargs: dict[str, Any] | None = None  # the template's own variables
    chat_template: str | None = None  # a template sent with the request: refused (not trusted)

    @model_validator(mode="after")
    def _one_way_to_end(self):
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                             "(set add_generation_prompt to false to continue the last message)")
        return self


class ChatCompletionRequest(ChatTemplateFields, _SamplingFields):
    TOOLS_IN_PROMPT: ClassVar[bool] = True
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # vLLM's extension (prepend the last message); not implemented

    def _own_unsupported(self) -> tuple[tuple[str, bool, str], ...]:
        return (("echo", self.echo, "echo is not supported on /v1/chat/completions by this server"),
                ("chat_template", self.chat_template is not None, UNTRUSTED_TEMPLATE))

    def logprobs_top(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def prompt_logprobs_top(self) -> int | None:
        return self.prompt_logprobs


class TokenizeCompletionRequest(BaseModel):
    """POST /tokenize with a prompt (vLLM's)."""
    model_config = ConfigDict(extra="ignore")  # as vLLM's: fields it does not know are ignored
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """POST /tokenize with chat messages (vLLM's): the prompt a chat completion would run."""
    model_config = ConfigDict(extra="ignore")  # as vLLM's: fields it does not know are ignored
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's)."""
    model_config = ConfigDict(extra="ignore")  # as vLLM's: fields it does not know are ignored
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
