"""Client process for the ROS tests: one JSON job on argv[1], one JSON answer on stdout.

Jobs:
  {"mode": "call",   "requests": [{...fields...}, ...]}       sequential service calls (tools: [{name, description,
                                                                parameters}])
  {"mode": "burst",  "requests": [...]}                         all service calls sent at once
  {"mode": "stream", "request": {...}, "cancel_after": N|null, "late_reader": bool}
                                 the action; cancel after N feedbacks; late_reader: then a new feedback
                                 subscription reports the text of each goal it receives ("late")
  {"mode": "diagnostics"}                                       the first DiagnosticArray seen
  {"mode": "lifecycle", "node": "/spec_edge", "transitions": [...], "request": {...}}
                                 drive the node's lifecycle; call the service once active and at the end;
                                 a transition {"set": {name: value}} sets parameters instead (the answers
                                 under "set", in order)
  {"mode": "params", "node": "/spec_edge", "describe": [names], "set": {name: value}}
                                 the node's describe_parameters / get_parameters answers, then a set
  {"mode": "tokenize", "requests": [{text, chat, ids}, ...]}  ~/tokenize calls (node /spec_edge)
  {"mode": "graph", "node": "spec_edge"}
                                 wait for the node in the ROS graph ("seen" on stderr), then report
                                 time.time() when it is gone from it
Optional: "namespace", "wait" (seconds for the server to appear), "start_at" (time.time() to send at).
"""
import json
import sys
import time

import rclpy

from spec_edge.ros2.client import GenerateClient, fill_request
from spec_edge.ros2.messages import response_to_dict


def spin(node, future, timeout: float = 60.0):
    rclpy.spin_until_future_complete(node, future, timeout_sec=timeout)
    assert future.done(), "no answer"
    return future.result()


def set_parameters(node, target: str, values: dict) -> list:
    """[{"successful", "reason"}] of setting values on target (none: [])."""
    if not values:
        return []
    from rclpy.parameter import Parameter
    from rclpy.parameter_client import AsyncParameterClient
    params = AsyncParameterClient(node, target)
    assert params.wait_for_services(timeout_sec=60), "no parameter services"
    results = spin(node, params.set_parameters([Parameter(k, value=v) for k, v in values.items()])).results
    return [{"successful": r.successful, "reason": r.reason} for r in results]


def request_fields(fields: dict) -> dict:
    """A job's request (JSON) -> GenerateClient fields: tools as {"name", "description", "parameters"} objects;
    images as {"b64", "encoding", "width", "height", "step"} (ImageInput, base64 data); compressed_images as
    {"b64", "format"} (sensor_msgs/CompressedImage as sent, any format)."""
    import base64

    from sensor_msgs.msg import CompressedImage
    from spec_edge.runtime.requests import ImageInput, Tool
    fields = dict(fields, tools=[Tool(**t) for t in fields.get("tools", ())])
    if "images" in fields:
        fields["images"] = [ImageInput(base64.b64decode(i.pop("b64")), **i) for i in fields["images"]]
    if "compressed_images" in fields:
        fields["compressed_images"] = [CompressedImage(format=c["format"], data=base64.b64decode(c["b64"]))
                                       for c in fields["compressed_images"]]
    return fields


def main() -> None:
    job = json.loads(sys.argv[1])
    rclpy.init(args=[])
    client = GenerateClient(namespace=job.get("namespace", ""))
    try:
        mode = job["mode"]
        if mode not in ("lifecycle", "params", "graph"):
            client.wait(job.get("wait", 60.0))
        if job.get("start_at"):  # several client processes sending at the same moment (time.time())
            time.sleep(max(0.0, job["start_at"] - time.time()))
        if mode == "call":
            out = [response_to_dict(client.call(timeout=300, **request_fields(r))) for r in job["requests"]]
        elif mode == "burst":
            futures = [client.service.call_async(fill_request(client.srv_type.Request(), **request_fields(r)))
                       for r in job["requests"]]
            deadline = time.monotonic() + 300
            while not all(f.done() for f in futures) and time.monotonic() < deadline:
                rclpy.spin_once(client.node, timeout_sec=0.1)
            out = [response_to_dict(f.result()) if f.done() else None for f in futures]
        elif mode == "stream":
            deltas, counts = [], []
            cancel_after = job.get("cancel_after")

            def on_feedback(fb):
                deltas.append(fb.delta)
                counts.append(fb.num_tokens)
                if cancel_after is not None and len(deltas) == cancel_after:
                    print(json.dumps({"event": "cancel"}), file=sys.stderr, flush=True)
                    return True
                if len(deltas) == 1:
                    print(json.dumps({"event": "first_feedback"}), file=sys.stderr, flush=True)
                return False

            result, status = client.stream(on_feedback, timeout=300, **request_fields(job["request"]))
            out = {"deltas": deltas, "num_tokens": counts, "status": status, "result": response_to_dict(result)}
            if job.get("late_reader"):  # a reader matched after the goal's feedback was sent
                by_goal: dict = {}
                client.subscribe_feedback(
                    lambda m: by_goal.setdefault(bytes(m.goal_id.uuid), []).append(m.feedback.delta))
                deadline = time.monotonic() + 10
                while result.text not in ("".join(d) for d in by_goal.values()) and time.monotonic() < deadline:
                    rclpy.spin_once(client.node, timeout_sec=0.05)
                out["late"] = ["".join(d) for d in by_goal.values()]
        elif mode == "lifecycle":  # [transition label, ...] then the service's presence
            from lifecycle_msgs.msg import Transition
            from lifecycle_msgs.srv import ChangeState
            ids = {"configure": Transition.TRANSITION_CONFIGURE, "activate": Transition.TRANSITION_ACTIVATE,
                   "deactivate": Transition.TRANSITION_DEACTIVATE, "cleanup": Transition.TRANSITION_CLEANUP,
                   "shutdown_active": Transition.TRANSITION_ACTIVE_SHUTDOWN,
                   "shutdown_inactive": Transition.TRANSITION_INACTIVE_SHUTDOWN}
            change = client.node.create_client(ChangeState, job["node"] + "/change_state")
            assert change.wait_for_service(timeout_sec=30), "no change_state service"
            out = {"set": []}
            for label in job["transitions"]:
                if isinstance(label, dict):
                    out["set"].append(set_parameters(client.node, job["node"], label["set"]))
                    continue
                future = change.call_async(ChangeState.Request(transition=Transition(id=ids[label])))
                rclpy.spin_until_future_complete(client.node, future, timeout_sec=300)
                assert future.done(), f"no answer to {label}"
                out[label] = bool(future.result().success)
                if label == "activate":
                    out["served"] = response_to_dict(client.call(timeout=300, **job["request"]))
            out["after"] = response_to_dict(client.call(timeout=60, **job["request"]))
        elif mode == "params":
            from rclpy.parameter_client import AsyncParameterClient
            params = AsyncParameterClient(client.node, job["node"])
            assert params.wait_for_services(timeout_sec=60), "no parameter services"
            described = spin(client.node, params.describe_parameters(job["describe"])).descriptors
            values = spin(client.node, params.get_parameters(job["describe"])).values
            out = {"describe": [{"name": d.name, "type": d.type, "description": d.description,
                                 "read_only": d.read_only, "additional_constraints": d.additional_constraints}
                                for d in described],
                   "values": [{"type": v.type, "integer_array": list(v.integer_array_value)} for v in values],
                   "set": set_parameters(client.node, job["node"], job.get("set", {}))}
        elif mode == "tokenize":
            from spec_edge_interfaces.srv import Tokenize
            tokenize = client.node.create_client(Tokenize, "/spec_edge/tokenize")
            assert tokenize.wait_for_service(timeout_sec=60), "no /spec_edge/tokenize"
            out = []
            for fields in job["requests"]:
                answer = spin(client.node, tokenize.call_async(Tokenize.Request(**fields)))
                out.append({"success": answer.success, "message": answer.message, "ids": list(answer.ids),
                            "text": answer.text})
        elif mode == "graph":
            deadline = time.monotonic() + 120
            names = lambda: [n for n, _ in client.node.get_node_names_and_namespaces()]  # noqa: E731
            while job["node"] not in names() and time.monotonic() < deadline:
                rclpy.spin_once(client.node, timeout_sec=0.05)
            assert job["node"] in names(), f"{job['node']} never appeared"
            print(json.dumps({"event": "seen"}), file=sys.stderr, flush=True)
            while job["node"] in names() and time.monotonic() < deadline:
                rclpy.spin_once(client.node, timeout_sec=0.02)
            out = {"gone_at": time.time()}
        elif mode == "diagnostics":
            from diagnostic_msgs.msg import DiagnosticArray
            got = []
            client.node.create_subscription(DiagnosticArray, "/diagnostics", got.append, 10)
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:
                rclpy.spin_once(client.node, timeout_sec=0.1)
            out = [{"name": s.name, "level": int.from_bytes(s.level, "little") if isinstance(s.level, bytes) else s.level,
                    "message": s.message, "values": {kv.key: kv.value for kv in s.values}}
                   for s in (got[0].status if got else [])]
        else:
            raise SystemExit(f"unknown mode {mode}")
    finally:
        client.close()
        rclpy.try_shutdown()
    print(json.dumps(out, ensure_ascii=False))


if __name__ == "__main__":
    main()
