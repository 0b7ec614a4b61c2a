"""Client process for the ROS tests: one JSON job on argv[1], one JSON answer on stdout.

Jobs:
  {"mode": "call",   "requests": [{...fields...}, ...]}       sequential service calls
  {"mode": "burst",  "requests": [...]}                         all service calls sent at once
  {"mode": "stream", "request": {...}, "cancel_after": N|null}  the action; cancel after N feedbacks
  {"mode": "diagnostics"}                                       the first DiagnosticArray seen
  {"mode": "lifecycle", "node": "/spec_edge", "transitions": [...], "request": {...}}
                                 drive the node's lifecycle; call the service once active and at the end
Optional: "namespace", "wait" (seconds for the server to appear), "start_at" (time.time() to send at).
"""
import json
import sys
import time

import rclpy

from spec_edge.ros2.client import GenerateClient, fill_request
from spec_edge.ros2.messages import response_to_dict


def main() -> None:
    job = json.loads(sys.argv[1])
    rclpy.init(args=[])
    client = GenerateClient(namespace=job.get("namespace", ""))
    try:
        mode = job["mode"]
        if mode != "lifecycle":
            client.wait(job.get("wait", 60.0))
        if job.get("start_at"):  # several client processes sending at the same moment (time.time())
            time.sleep(max(0.0, job["start_at"] - time.time()))
        if mode == "call":
            out = [response_to_dict(client.call(timeout=300, **r)) for r in job["requests"]]
        elif mode == "burst":
            futures = [client.service.call_async(fill_request(client.srv_type.Request(), **r))
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

            result, status = client.stream(on_feedback, timeout=300, **job["request"])
            out = {"deltas": deltas, "num_tokens": counts, "status": status, "result": response_to_dict(result)}
        elif mode == "lifecycle":  # [transition label, ...] then the service's presence
            from lifecycle_msgs.msg import Transition
            from lifecycle_msgs.srv import ChangeState
            ids = {"configure": Transition.TRANSITION_CONFIGURE, "activate": Transition.TRANSITION_ACTIVATE,
                   "deactivate": Transition.TRANSITION_DEACTIVATE, "cleanup": Transition.TRANSITION_CLEANUP}
            change = client.node.create_client(ChangeState, job["node"] + "/change_state")
            assert change.wait_for_service(timeout_sec=30), "no change_state service"
            out = {}
            for label in job["transitions"]:
                future = change.call_async(ChangeState.Request(transition=Transition(id=ids[label])))
                rclpy.spin_until_future_complete(client.node, future, timeout_sec=300)
                assert future.done(), f"no answer to {label}"
                out[label] = bool(future.result().success)
                if label == "activate":
                    out["served"] = response_to_dict(client.call(timeout=300, **job["request"]))
            out["after"] = response_to_dict(client.call(timeout=60, **job["request"]))
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
