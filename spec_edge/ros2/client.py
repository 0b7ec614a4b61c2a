"""A ROS 2 client of the spec_edge node: `spec-edge ask`, and helpers other Python code can call.

    import rclpy

    from spec_edge.ros2.client import GenerateClient
    from spec_edge.runtime.requests import Tool

    rclpy.init()
    with GenerateClient() as client:
        response = client.call(prompt="Hello", max_new_tokens=32)
        print(response.text, response.stats.tokens_per_s)

        def show(feedback):                                # the action: text as it comes
            print(feedback.delta, end="", flush=True)
        result, status = client.stream(show, prompt="Hello", max_new_tokens=32)
        print(f"\\n{status}: {result.finish_reason}")

        # tools: the agent loop (call, run the tool, call again until a text answer; examples/agent_ros.py)
        say = Tool("say", "Say a sentence aloud.",
                   '{"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}')
        run = client.run_tools([("user", "Greet the visitor.")], [say], {"say": lambda text: "said"},
                               tool_choice="required", max_turns=2, max_new_tokens=64)
        print(run.calls, run.answer.text)
    rclpy.shutdown()

No call can hang: each first waits until the node has answered this client once (GenerateClient.wait: the
service; wait_for_action: the action's goal and result services), at most wait_timeout seconds, then for the
answer at most timeout seconds; past either, TimeoutError says which and what to check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Callable

OPTIONAL_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")
GUIDED_FIELDS = ("json_schema", "grammar", "regex")  # msg/Guided.msg, the request's `guided` field
# after an action's result: how long feedback still on its way is waited for (the wait ends as soon as the
# deltas add up to the result's text). Past Fast DDS's default heartbeat period (3 s), after which a reliable
# writer resends what a reader missed, and a transient-local writer sends its history to a reader matched late.
FEEDBACK_DRAIN_S = 5.0


def fill_request(msg: Any, *, messages: Sequence[Any] = (), tools: Sequence[Any] = (), **fields: Any) -> Any:
    """Set a Generate request / goal from plain values (messages: requests.ChatMessage or (role, content) pairs;
    tools: requests.Tool; logit_bias: (token id, bias) pairs; images: requests.ImageInput, raw ones before files as
    the node binds them); None leaves a field at the node default."""
    from spec_edge.ros2.messages import tool_call_messages
    from spec_edge.runtime.requests import ChatMessage as Turn
    from spec_edge_interfaces.msg import ChatMessage, LogitBias, Tool
    for name, value in fields.items():
        if name in GUIDED_FIELDS:
            setattr(msg.guided, name, value or "")
            continue
        if name == "images":
            msg.images, msg.compressed_images = image_messages(value)
            continue
        if name == "logit_bias":
            msg.logit_bias = [LogitBias(token_id=int(t), bias=float(b)) for t, b in value]
            continue
        if name not in msg.get_fields_and_field_types():
            raise TypeError(f"Generate has no field '{name}'")
        if value is None:
            continue
        if name in OPTIONAL_FIELDS:
            value = [value]
        elif name == "stop":
            value = list(value)
        setattr(msg, name, value)
    turns = [Turn(*m) for m in messages]  # a pair is a turn without tool calls
    msg.messages = [ChatMessage(role=t.role, content=t.content, tool_calls=tool_call_messages(t.tool_calls),
                                tool_call_id=t.tool_call_id) for t in turns]
    msg.tools = [Tool(name=t.name, description=t.description, parameters=t.parameters) for t in tools]
    return msg


def image_messages(images: Sequence[Any]) -> tuple[list, list]:
    """requests.ImageInput objects -> (sensor_msgs/Image list, sensor_msgs/CompressedImage list); ValueError where
    a raw image follows a file, as the node binds `images` first and would reorder them."""
    from sensor_msgs.msg import CompressedImage, Image
    files = [i for i, image in enumerate(images) if image.encoding in ("jpeg", "png")]
    if files != list(range(len(images) - len(files), len(images))):
        raise ValueError("the node binds raw images (sensor_msgs/Image) before files (CompressedImage): "
                         "give the raw ones first")
    raw = [Image(data=image.data, encoding=image.encoding, width=image.width, height=image.height, step=image.step)
           for image in images[:len(images) - len(files)]]
    return raw, [CompressedImage(format=images[i].encoding, data=images[i].data) for i in files]


@dataclass(frozen=True)
class ToolRun:
    """What GenerateClient.run_tools did: the final answer, the conversation that led to it, the calls it ran."""
    answer: Any                      # the last Generate response (its text is the answer; no tool_calls)
    messages: tuple[Any, ...]        # requests.ChatMessage: the given turns, then each assistant turn and tool result,
                                     # then the answer's assistant turn
    calls: tuple[tuple[Any, str], ...]  # (requests.ToolCall, the result its function gave), in the order run


class GenerateClient:
    """Calls the node's `generate` service (and action, for streaming) from a node of its own.

    wait_timeout: seconds a first call waits for the node to answer this client at all (readiness);
    timeout: seconds a call waits for its answer (a call's own timeout replaces it)."""

    def __init__(self, namespace: str = "", node_name: str = "spec_edge_client", *, wait_timeout: float = 60.0,
                 timeout: float = 600.0):
        from rclpy.action import ActionClient
        from rclpy.node import Node

        from spec_edge.ros2.node import ACTION_NAME, SERVICE_NAME, action_qos_kwargs, endpoint_qos
        from spec_edge_interfaces.action import Generate as GenerateAction
        from spec_edge_interfaces.srv import Generate as GenerateSrv
        self.node = Node(node_name, namespace=namespace)
        self.srv_type, self.action_type = GenerateSrv, GenerateAction
        self.service = self.node.create_client(GenerateSrv, SERVICE_NAME, qos_profile=endpoint_qos())
        self.action = ActionClient(self.node, GenerateAction, ACTION_NAME,
                                   **action_qos_kwargs("feedback_sub_qos_profile"))
        self.action_name = self.node.resolve_service_name(ACTION_NAME)
        # feedback through a subscription of our own (the action's feedback topic, routed by goal id): rclpy's
        # ActionClient drops a goal's feedback callback once its result is in, and the result (a service reply)
        # can overtake the last feedback (a topic message), whose delta would be lost
        self._feedback_routes: dict[bytes, Callable[[Any], None]] = {}
        self._feedback_sub = self.subscribe_feedback(self._route_feedback)
        self.wait_timeout, self.timeout = wait_timeout, timeout
        self._service_ready = self._action_ready = False

    def subscribe_feedback(self, callback: Callable[[Any], None]) -> Any:
        """A subscription of this client's node to the action's feedback topic (feedback_qos()): callback gets
        every goal's FeedbackMessage (goal_id, feedback), the history the node still keeps included."""
        from spec_edge.ros2.node import ACTION_NAME, feedback_qos
        return self.node.create_subscription(self.action_type.Impl.FeedbackMessage,
                                             f"{ACTION_NAME}/_action/feedback", callback, feedback_qos())

    def _route_feedback(self, msg: Any) -> None:
        route = self._feedback_routes.get(bytes(msg.goal_id.uuid))
        if route is not None:
            route(msg)

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.action.destroy()
        self.node.destroy_node()

    def _spin_until(self, future: Any, timeout: float, what: str) -> Any:
        """future's result, spinning this client's node at most timeout seconds (TimeoutError naming what)."""
        import rclpy
        if timeout <= 0:  # rclpy spins forever on a negative timeout
            raise ValueError(f"timeout must be > 0 s, got {timeout}")
        rclpy.spin_until_future_complete(self.node, future, timeout_sec=timeout)
        if not future.done():
            raise TimeoutError(f"no answer {what} within {timeout} s: is the node still running, or is it busy "
                               "with longer requests (raise the timeout)?")
        return future.result()

    def _ping(self, send: Callable[[], Any], timeout: float, ping_every: float, name: str,
              forget: Callable[[Any], None] = lambda future: None) -> Any:
        """The answer to send() (a request the node answers at once, without generating), resent every
        ping_every seconds until one answer arrives (forget(future) drops an unanswered one). Appearing in the
        graph only proves the request path: Fast DDS can drop a reply the server sends before its reply
        writer has matched this client's new reader, and a call would then wait forever."""
        import rclpy
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:  # a negative timeout would make rclpy spin forever
            future = send()
            rclpy.spin_until_future_complete(self.node, future, timeout_sec=min(ping_every, left))
            if future.done():
                return future.result()
            forget(future)
        raise TimeoutError(f"{name} appeared but sent no reply within {timeout} s")

    def wait(self, timeout: float | None = None, ping_every: float = 1.0) -> None:
        """Until the node's service has answered this client once (or TimeoutError after timeout s, default
        wait_timeout): an empty request, refused at once by validation, resent every ping_every seconds."""
        timeout = self.wait_timeout if timeout is None else timeout
        name = self.node.resolve_service_name(self.service.srv_name)
        if not self.service.wait_for_service(timeout_sec=timeout):
            raise TimeoutError(f"service {name} did not appear within {timeout} s; "
                               "is the node running (same ROS_DOMAIN_ID)?")
        self._ping(lambda: self.service.call_async(self.srv_type.Request()), timeout, ping_every,
                   f"service {name}", forget=self.service.remove_pending_request)
        self._service_ready = True

    def wait_for_action(self, timeout: float | None = None, ping_every: float = 1.0) -> None:
        """Until the node's action has answered this client once through its goal service and its result
        service (or TimeoutError after timeout s, default wait_timeout): an empty goal, which the node aborts
        at once (validation), resent every ping_every seconds."""
        import rclpy
        timeout = self.wait_timeout if timeout is None else timeout
        name = f"action {self.action_name}"
        deadline = time.monotonic() + timeout
        if not self.action.wait_for_server(timeout_sec=timeout):
            raise TimeoutError(f"{name} did not appear within {timeout} s; is the node running (same ROS_DOMAIN_ID)?")
        # our own feedback subscription must be matched too, or a fresh process loses a goal's first deltas
        # (wait_for_server counts only the ActionClient's own feedback subscription)
        while self._feedback_sub.get_publisher_count() < 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name}: its feedback topic did not reach this client within {timeout} s")
            rclpy.spin_once(self.node, timeout_sec=0.05)
        handle = self._ping(lambda: self.action.send_goal_async(self.action_type.Goal()),
                            max(deadline - time.monotonic(), 0.1), ping_every, f"{name} (its goal service)")
        if handle.accepted:  # its result proves the result service's replies reach this client too
            self._ping(handle.get_result_async, max(deadline - time.monotonic(), 0.1), ping_every,
                       f"{name} (its result service)")
        self._action_ready = True

    def call(self, timeout: float | None = None, **fields: Any) -> Any:
        """One service call; returns the Generate response message (TimeoutError after timeout s, default
        self.timeout; the first call waits for readiness first, wait())."""
        if not self._service_ready:
            self.wait()
        timeout = self.timeout if timeout is None else timeout
        request = fill_request(self.srv_type.Request(), **fields)
        future = self.service.call_async(request)
        try:
            return self._spin_until(future, timeout, f"from {self.node.resolve_service_name(self.service.srv_name)}")
        except TimeoutError:
            self.service.remove_pending_request(future)
            raise

    def run_tools(self, messages: Sequence[Any], tools: Sequence[Any], functions: Mapping[str, Callable[..., Any]],
                  *, tool_choice: str = "auto", max_turns: int = 4, **fields: Any) -> ToolRun:
        """The agent loop over the service: call with messages and tools; while the answer calls tools, run each
        call's function (functions[call.name](**arguments), its return value the tool turn's content:
        tool_result_text), append the assistant turn with its calls and one tool turn per result (the call's id),
        and call again. Every call but the last asks with tool_choice; call number max_turns asks with "none", so
        the run ends in a text answer after at most max_turns calls (with tool_choice "required" it runs all of
        them). fields: the other Generate fields, the same for every call. A call the node refuses or fails raises
        RuntimeError with its message; a function's exception propagates."""
        from spec_edge.ros2.messages import tool_calls
        from spec_edge.runtime.requests import ChatMessage, ToolCall
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        names = {t.name for t in tools}
        if missing := sorted(names - set(functions)):
            raise ValueError(f"no function for the tools {missing}: functions maps each tool's name to its function")
        turns = [ChatMessage(*m) for m in messages]
        ran: list[tuple[ToolCall, str]] = []
        for turn in range(1, max_turns + 1):
            answer = self.call(messages=turns, tools=tools,
                               tool_choice=tool_choice if turn < max_turns else "none", **fields)
            if not answer.success:
                raise RuntimeError(f"the node refused call {turn} of the tool loop: {answer.message}")
            calls = tool_calls(answer.tool_calls)
            turns.append(ChatMessage("assistant", answer.text, calls))
            if not calls:
                return ToolRun(answer, tuple(turns), tuple(ran))
            for call in calls:
                result = tool_result_text(functions[call.name](**json.loads(call.arguments)))
                ran.append((call, result))
                turns.append(ChatMessage("tool", result, tool_call_id=call.id))
        raise RuntimeError(f"call {max_turns} asked with tool_choice none and still got tool calls: a node bug")

    def answered_by(self, timeout: float | None = None) -> dict[str, str]:
        """{"profile": runtime.profile, "weights": graphs.weights} of the node (its parameters, read at configure
        and fixed while it holds the engine: what its answers came from), as `spec-edge generate --json` names them."""
        from rcl_interfaces.srv import GetParameters

        from spec_edge.ros2.node import NODE_NAME
        names = {"runtime.profile": "profile", "graphs.weights": "weights"}
        client = self.node.create_client(GetParameters, f"{NODE_NAME}/get_parameters")
        try:
            timeout = self.timeout if timeout is None else timeout
            if not client.wait_for_service(timeout_sec=min(timeout, self.wait_timeout)):
                raise TimeoutError(f"{client.srv_name} did not appear: is the node running?")
            reply = self._spin_until(client.call_async(GetParameters.Request(names=list(names))), timeout,
                                     f"from {client.srv_name}")
        finally:
            self.node.destroy_client(client)
        return {key: value.string_value for key, value in zip(names.values(), reply.values)}

    def stream(self, on_feedback: Callable[[Any], bool | None] | None = None,
               timeout: float | None = None, **fields: Any) -> tuple[Any, str]:
        """Run the action; on_feedback(feedback) may return True to cancel the goal. The goal's acceptance and
        its result each wait at most timeout s (default self.timeout; the first call waits for readiness
        first, wait_for_action()).

        Once the result is in, feedback still on its way is taken (at most FEEDBACK_DRAIN_S), so the deltas
        on_feedback saw add up to the result's text. Returns (result message, goal status name: SUCCEEDED |
        CANCELED | ABORTED)."""
        import rclpy
        from action_msgs.msg import GoalStatus
        from unique_identifier_msgs.msg import UUID
        if not self._action_ready:
            self.wait_for_action()
        timeout = self.timeout if timeout is None else timeout
        goal = fill_request(self.action_type.Goal(), **fields)
        state = {"handle": None, "cancel": False, "sent": False}
        shown: list[str] = []  # the deltas handed to on_feedback

        def cancel_if_wanted() -> None:
            # feedback can arrive before the goal handle does: the cancel waits for the handle
            if state["cancel"] and state["handle"] is not None and not state["sent"]:
                state["sent"] = True
                state["handle"].cancel_goal_async()

        def feedback_cb(msg: Any) -> None:
            shown.append(msg.feedback.delta)
            if on_feedback is not None and on_feedback(msg.feedback):
                state["cancel"] = True
            cancel_if_wanted()

        goal_id = UUID(uuid=list(uuid.uuid4().bytes))
        self._feedback_routes[bytes(goal_id.uuid)] = feedback_cb
        try:
            handle = self._spin_until(self.action.send_goal_async(goal, goal_uuid=goal_id), timeout,
                                      "to the goal (accepted or rejected)")
            if not handle.accepted:
                raise RuntimeError("the node rejected the goal")
            state["handle"] = handle
            cancel_if_wanted()
            wrapped = self._spin_until(handle.get_result_async(), timeout, "with the goal's result")
            # the result can overtake the last feedback: take what is still on its way
            drain_until = time.monotonic() + FEEDBACK_DRAIN_S
            while "".join(shown) != wrapped.result.text and time.monotonic() < drain_until:
                rclpy.spin_once(self.node, timeout_sec=0.05)
        finally:
            del self._feedback_routes[bytes(goal_id.uuid)]
        names = {v: k for k, v in vars(GoalStatus).items() if k.startswith("STATUS_")}
        return wrapped.result, names.get(wrapped.status, str(wrapped.status)).removeprefix("STATUS_")


def tool_result_text(value: Any) -> str:
    """A tool function's return value as a tool turn's content: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def ask_main(argv: list[str] | None = None) -> int:
    """`spec-edge ask --prompt P [--json]`: one call of /generate, printed."""
    from spec_edge.runtime.request_args import add_request_arguments
    parser = argparse.ArgumentParser(prog="spec-edge ask", description="Call the spec_edge node's generate service.")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system-prompt", default="")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--no-speculate", action="store_true", help="plain decoding by the target alone")
    parser.add_argument("--drafter", default="")
    parser.add_argument("--k", type=int)
    parser.add_argument("--namespace", default="", help="namespace of the node")
    parser.add_argument("--stream", action="store_true", help="use the action and print text as it comes")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds to wait for the node to appear")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the answer")
    parser.add_argument("--json", action="store_true", help="print one JSON object with every response field")
    add_request_arguments(parser)
    args = parser.parse_args(argv)
    if args.logprobs and not args.json:
        parser.error("--logprobs is reported in --json's `logprobs` key: add --json")

    from spec_edge.runtime.request_args import request_fields
    from spec_edge.runtime.requests import RequestError

    import rclpy

    from spec_edge.ros2.messages import response_to_dict

    if "ROS_AUTOMATIC_DISCOVERY_RANGE" not in os.environ:
        print("spec-edge ask: note: ROS_AUTOMATIC_DISCOVERY_RANGE is unset; "
              "set it to LOCALHOST to keep discovery on this machine", file=sys.stderr)
    try:
        fields = dict(prompt=args.prompt, system_prompt=args.system_prompt, max_new_tokens=args.max_new_tokens,
                      temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                      stop=args.stop, speculate=not args.no_speculate, drafter=args.drafter, k=args.k,
                      **request_fields(args))
    except RequestError as err:
        parser.error(str(err))
    rclpy.init(args=[])
    try:
        with GenerateClient(namespace=args.namespace, wait_timeout=args.wait, timeout=args.timeout) as client:
            try:
                if args.stream:
                    def show(feedback: Any) -> None:
                        if not args.json:
                            print(feedback.delta, end="", flush=True)
                    response, _ = client.stream(show, **fields)
                    if not args.json:
                        print()
                else:
                    response = client.call(**fields)
                answered = client.answered_by() if args.json else {}
            except TimeoutError as err:
                print(f"spec-edge ask: {err}", file=sys.stderr)
                return 3
    finally:
        rclpy.try_shutdown()
    if args.json:
        print(json.dumps({**response_to_dict(response), **answered}, ensure_ascii=False, allow_nan=False))
    elif response.success:
        if not args.stream:
            print(response.text)
        for call in response.tool_calls:
            print(f"[tool call {call.id}: {call.name}({call.arguments})]")
        s = response.stats
        print(f"[{response.finish_reason}, {response.num_tokens} tokens, {s.tokens_per_s:.1f} tok/s, "
              f"drafter {s.drafter or 'none'} k={s.k}, acceptance {s.acceptance_rate:.2f}]", file=sys.stderr)
        if s.speculation_off_reason:
            print(f"[speculation policy: {s.speculation_off_reason}]", file=sys.stderr)
        if response.message:
            print(f"[note: {response.message}]", file=sys.stderr)
    else:
        print(f"spec-edge ask: refused: {response.message}", file=sys.stderr)
    return 0 if response.success else 2  # refused: 2, as `spec-edge generate` (a timeout: 3)


if __name__ == "__main__":
    sys.exit(ask_main())
