"""A ROS 2 client of the spec_edge node: `spec-edge ask`, and helpers other Python code can call.

    from spec_edge.ros2.client import GenerateClient
    with GenerateClient() as client:                       # rclpy.init() must have been called
        response = client.call(prompt="Hello", max_new_tokens=32)
        print(response.text, response.stats.tokens_per_s)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

OPTIONAL_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty")
GUIDED_FIELDS = ("json_schema", "grammar", "regex")  # msg/Guided.msg, the request's `guided` field


def fill_request(msg: Any, *, messages: list[tuple[str, str]] | tuple = (), **fields: Any) -> Any:
    """Set a Generate request / goal from plain values (logit_bias: (token id, bias) pairs); None leaves a
    field at the node default."""
    from spec_edge_interfaces.msg import ChatMessage, LogitBias
    for name, value in fields.items():
        if name in GUIDED_FIELDS:
            setattr(msg.guided, name, value or "")
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
    msg.messages = [ChatMessage(role=role, content=content) for role, content in messages]
    return msg


class GenerateClient:
    """Calls the node's `generate` service (and action, for streaming) from a node of its own."""

    def __init__(self, namespace: str = "", node_name: str = "spec_edge_client"):
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

    def __enter__(self) -> "GenerateClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        self.action.destroy()
        self.node.destroy_node()

    def _spin_until(self, future: Any, timeout: float | None) -> Any:
        import rclpy
        rclpy.spin_until_future_complete(self.node, future, timeout_sec=timeout)
        if not future.done():
            raise TimeoutError(f"no answer from {self.node.resolve_service_name(self.service.srv_name)} "
                               f"within {timeout} s")
        return future.result()

    def wait(self, timeout: float = 30.0, ping_every: float = 1.0) -> None:
        """Until the node has answered this client once (or TimeoutError).

        wait_for_service only proves the request path: Fast DDS can drop a reply the server sends
        before its reply writer has matched this client's new reader, and a call would then wait
        forever. So after the service appears, an empty request (refused at once by validation,
        no generation) is resent every ping_every seconds until one answer arrives."""
        import rclpy
        name = self.node.resolve_service_name(self.service.srv_name)
        deadline = time.monotonic() + timeout
        if not self.service.wait_for_service(timeout_sec=timeout):
            raise TimeoutError(f"service {name} did not appear within {timeout} s; "
                               "is the node running (same ROS_DOMAIN_ID)?")
        while (left := deadline - time.monotonic()) > 0:  # a negative timeout would make rclpy spin forever
            ping = self.service.call_async(self.srv_type.Request())
            rclpy.spin_until_future_complete(self.node, ping, timeout_sec=min(ping_every, left))
            if ping.done():
                return
            self.service.remove_pending_request(ping)
        raise TimeoutError(f"service {name} appeared but sent no reply within {timeout} s")

    def call(self, timeout: float | None = None, **fields: Any) -> Any:
        """One service call; returns the Generate response message."""
        request = fill_request(self.srv_type.Request(), **fields)
        return self._spin_until(self.service.call_async(request), timeout)

    def stream(self, on_feedback: Callable[[Any], bool | None] | None = None,
               timeout: float | None = None, **fields: Any) -> tuple[Any, str]:
        """Run the action; on_feedback(feedback) may return True to cancel the goal.

        Returns (result message, goal status name: SUCCEEDED | CANCELED | ABORTED)."""
        from action_msgs.msg import GoalStatus
        if not self.action.wait_for_server(timeout_sec=timeout or 30.0):
            raise TimeoutError("action server 'generate' did not appear")
        goal = fill_request(self.action_type.Goal(), **fields)
        state = {"handle": None, "cancel": False, "sent": False}

        def cancel_if_wanted() -> None:
            # feedback can arrive before the goal handle does: the cancel waits for the handle
            if state["cancel"] and state["handle"] is not None and not state["sent"]:
                state["sent"] = True
                state["handle"].cancel_goal_async()

        def feedback_cb(msg: Any) -> None:
            if on_feedback is not None and on_feedback(msg.feedback):
                state["cancel"] = True
            cancel_if_wanted()

        handle = self._spin_until(self.action.send_goal_async(goal, feedback_callback=feedback_cb), timeout)
        if not handle.accepted:
            raise RuntimeError("the node rejected the goal")
        state["handle"] = handle
        cancel_if_wanted()
        wrapped = self._spin_until(handle.get_result_async(), timeout)
        names = {v: k for k, v in vars(GoalStatus).items() if k.startswith("STATUS_")}
        return wrapped.result, names.get(wrapped.status, str(wrapped.status)).removeprefix("STATUS_")


def ask_main(argv: list[str] | None = None) -> int:
    """`spec-edge ask --prompt P [--json]`: one call of /generate, printed."""
    from spec_edge.runtime.requests import add_distribution_arguments
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
    add_distribution_arguments(parser)
    for flag, what in (("--json-schema", "JSON Schema the output must be valid against"),
                       ("--grammar", "grammar of the output: Lark (`start: ...`) or GBNF (`root ::= ...`)"),
                       ("--regex", "regular expression the whole output must match")):
        parser.add_argument(flag, help=f"guided decoding (at most one): {what}; the text or a file path")
    args = parser.parse_args(argv)
    if args.logprobs and not args.json:
        parser.error("--logprobs is reported in --json's `logprobs` key: add --json")

    from spec_edge.runtime.grammar import text_or_file
    from spec_edge.runtime.requests import distribution_fields

    import rclpy

    from spec_edge.ros2.messages import response_to_dict

    if "ROS_AUTOMATIC_DISCOVERY_RANGE" not in os.environ:
        print("spec-edge ask: note: ROS_AUTOMATIC_DISCOVERY_RANGE is unset; "
              "set it to LOCALHOST to keep discovery on this machine", file=sys.stderr)
    fields = dict(prompt=args.prompt, system_prompt=args.system_prompt, max_new_tokens=args.max_new_tokens,
                  temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                  stop=args.stop, speculate=not args.no_speculate, drafter=args.drafter, k=args.k,
                  json_schema=text_or_file(args.json_schema), grammar=text_or_file(args.grammar),
                  regex=text_or_file(args.regex), **distribution_fields(args))
    rclpy.init(args=[])
    try:
        with GenerateClient(namespace=args.namespace) as client:
            try:
                client.wait(args.wait)
                if args.stream:
                    def show(feedback: Any) -> None:
                        if not args.json:
                            print(feedback.delta, end="", flush=True)
                    response, _ = client.stream(show, timeout=args.timeout, **fields)
                    if not args.json:
                        print()
                else:
                    response = client.call(timeout=args.timeout, **fields)
            except TimeoutError as err:
                print(f"spec-edge ask: {err}", file=sys.stderr)
                return 3
    finally:
        rclpy.try_shutdown()
    if args.json:
        print(json.dumps(response_to_dict(response), ensure_ascii=False))
    elif response.success:
        if not args.stream:
            print(response.text)
        s = response.stats
        print(f"[{response.finish_reason}, {response.num_tokens} tokens, {s.tokens_per_s:.1f} tok/s, "
              f"drafter {s.drafter or 'none'} k={s.k}, acceptance {s.acceptance_rate:.2f}]", file=sys.stderr)
        if s.speculation_off_reason:
            print(f"[speculation policy: {s.speculation_off_reason}]", file=sys.stderr)
        if response.message:
            print(f"[note: {response.message}]", file=sys.stderr)
    else:
        print(f"spec-edge ask: refused: {response.message}", file=sys.stderr)
    return 0 if response.success else 1


if __name__ == "__main__":
    sys.exit(ask_main())
