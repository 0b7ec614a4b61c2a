"""Translation between the Generate / Tokenize messages and the engine: a service request or action
goal -> GenerateRequest, an engine result -> Outcome -> response / action result,
a Tokenize request -> ids or text, a response -> plain dict (`spec-edge ask --json`). Tools, tool calls and chat
turns map one-to-one onto runtime/requests.py's Tool, ToolCall and ChatMessage; sensor_msgs/Image and
CompressedImage onto ImageInput (the front decodes and checks them: runtime/images.py).

No rclpy here: the functions take the message objects they are handed.
"""
from __future__ import annotations

import math
from typing import Any

from spec_edge.runtime.front import Front
from spec_edge.runtime.requests import GenerateRequest, ImageInput, RequestError
from spec_edge.runtime.scheduler import Outcome



def _optional(values: Any) -> Any:
    """A bounded `T[<=1]` field -> its value, or None when empty (node default)."""
    return values[0] if len(values) else None


def to_engine_request(msg: Any) -> GenerateRequest:
    """A Generate service request or action goal -> GenerateRequest; the front checks its fields.

    rclpy decodes a string field with errors="replace": bytes that are not UTF-8 arrive as U+FFFD, which the
    node cannot tell from a U+FFFD the client meant, so both are text here. A NUL ends a ROS string: what
    follows it never reaches the node."""
    from spec_edge.runtime.requests import Tool
    def number(values: Any) -> float | None:
        value = _optional(values)
        return None if value is None else float(value)

    return GenerateRequest(
        prompt=msg.prompt,
        messages=tuple(chat_message(m) for m in msg.messages),
        system_prompt=msg.system_prompt,
        max_new_tokens=_optional(msg.max_new_tokens),
        temperature=number(msg.temperature),
        top_p=number(msg.top_p),
        top_k=_optional(msg.top_k),
        min_p=number(msg.min_p),
        repetition_penalty=number(msg.repetition_penalty),
        presence_penalty=number(msg.presence_penalty),
        frequency_penalty=number(msg.frequency_penalty),
        logit_bias=tuple((int(b.token_id), float(b.bias)) for b in msg.logit_bias),
        ignore_eos=bool(msg.ignore_eos),
        logprobs=int(msg.logprobs),
        seed=_optional(msg.seed),
        stop=tuple(msg.stop),
        speculate=bool(msg.speculate),
        drafter=msg.drafter or None,
        k=_optional(msg.k),
        json_schema=msg.guided.json_schema,
        grammar=msg.guided.grammar,
        regex=msg.guided.regex,
        tools=tuple(Tool(name=t.name, description=t.description, parameters=t.parameters or Tool.parameters)
                    for t in msg.tools),
        tool_choice=msg.tool_choice or GenerateRequest.tool_choice,  # "" = the request's default (auto)
        parallel_tool_calls=bool(msg.parallel_tool_calls),
        images=tuple(raw_image(m) for m in msg.images) + tuple(
            compressed_image(m, f"compressed_images[{i}]") for i, m in enumerate(msg.compressed_images)),
    )


def raw_image(msg: Any) -> ImageInput:
    """A sensor_msgs/Image -> ImageInput with its encoding as sent (the front refuses one it does not take; 8-bit
    encodings only, so is_bigendian does not matter)."""
    return ImageInput(data=bytes(msg.data), encoding=msg.encoding, width=int(msg.width), height=int(msg.height),
                      step=int(msg.step))


def compressed_image(msg: Any, name: str) -> ImageInput:
    """A sensor_msgs/CompressedImage -> ImageInput. format: "jpeg" / "png" (also "jpg") or image_transport's
    "<encoding>; jpeg compressed <encoding>" (the file is a plain JPEG / PNG either way); RequestError naming it as
    `name` for another format (compressedDepth, an empty one)."""
    words = msg.format.lower().replace(";", " ").split()
    if "compresseddepth" in words:
        raise RequestError(f"{name} has format '{msg.format}' (a depth image): send a colour or mono jpeg / png")
    named = {{"jpg": "jpeg"}.get(w, w) for w in words}
    encoding = next((e for e in ("jpeg", "png") if e in named), "")
    if not encoding:
        raise RequestError(f"{name} has format '{msg.format}': set format to \"jpeg\" or \"png\" (or "
                           "image_transport's \"rgb8; jpeg compressed bgr8\") and send that file's bytes")
    return ImageInput(data=bytes(msg.data), encoding=encoding)


def chat_message(msg: Any):
    """A ChatMessage message -> requests.ChatMessage (its tool calls and the tool turn's call id included)."""
    from spec_edge.runtime.requests import ChatMessage
    return ChatMessage(msg.role, msg.content, tool_calls(msg.tool_calls), msg.tool_call_id)


def tool_calls(msgs: Any) -> tuple:
    """ToolCall messages (a response's, or a chat turn's) -> requests.ToolCall objects."""
    from spec_edge.runtime.requests import ToolCall
    return tuple(ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in msgs)


def tool_call_messages(calls: Any) -> list:
    """requests.ToolCall objects -> ToolCall messages (a result's, or an assistant turn's going back)."""
    from spec_edge_interfaces.msg import ToolCall
    return [ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def fill_response(resp: Any, outcome: Outcome) -> Any:
    """Write an Outcome into a Generate response / action result message."""
    resp.success = outcome.success
    resp.message = outcome.message
    resp.text = outcome.text
    resp.num_tokens = outcome.num_tokens
    resp.token_ids = [int(t) for t in outcome.token_ids]
    if outcome.logprobs:
        from spec_edge_interfaces.msg import TokenLogprobs
        resp.logprobs = [TokenLogprobs(token_id=e.token_id, logprob=e.logprob, top_ids=list(e.top_ids),
                                       top_logprobs=list(e.top_logprobs)) for e in outcome.logprobs]
    resp.finish_reason = outcome.finish_reason
    resp.tool_calls = tool_call_messages(outcome.tool_calls)
    for name, kind in resp.stats.get_fields_and_field_types().items():
        if name in outcome.stats and outcome.stats[name] is not None:
            current = getattr(resp.stats, name)
            value = outcome.stats[name]
            if kind.startswith("sequence<"):  # uint32[] (e.g. verify_calls_by_k)
                value = [int(v) for v in value]
            elif isinstance(current, str):
                value = str(value)
            elif isinstance(current, int):
                value = int(value)
            else:
                value = float(value)
                if not math.isfinite(value):
                    value = 0.0
            setattr(resp.stats, name, value)
    return resp


def tokenize(front: Front, msg: Any) -> tuple[list[int], str]:
    """A Tokenize request -> (ids, text) through the scheduler's front: ids of msg.text (through the chat template
    as a Generate prompt would be, with msg.chat), or the text of msg.ids. RequestError with what to change."""
    from spec_edge.runtime.requests import RequestError
    if bool(msg.text) == bool(len(msg.ids)):
        raise RequestError("give text (to tokenize) or ids (to detokenize), not both and not neither")
    if msg.text:
        return front.tokenize(msg.text, chat=bool(msg.chat)), ""
    return [], front.detokenize([int(t) for t in msg.ids])


def _plain(value: Any) -> Any:
    """A message field's value as JSON takes it (an array field arrives as array.array or numpy, a message
    as an object with fields)."""
    if isinstance(value, (str, int, float, bool)):
        return value
    if hasattr(value, "get_fields_and_field_types"):
        return {name: _plain(getattr(value, name)) for name in value.get_fields_and_field_types()}
    return [_plain(v.item() if hasattr(v, "item") else v) for v in value]


def response_to_dict(resp: Any) -> dict[str, Any]:
    """A Generate response / action result -> plain dict (the `spec-edge ask --json` object; logprobs only
    when the request asked for them, as `spec-edge generate --json`)."""
    out = {name: _plain(getattr(resp, name)) for name in resp.get_fields_and_field_types()}
    if not out["logprobs"]:
        del out["logprobs"]
    return out
