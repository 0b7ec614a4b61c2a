"""One client process of bench/concurrency.py: waits for the node, sleeps until start_at
(time.time()), streams one request through the action and prints one JSON line: ttft_s (first
feedback), latency_s, num_tokens, success, text, stats. argv[1]: {"start_at": t, "request": {...}}."""
import json
import sys
import time

import rclpy

from spec_edge.ros2.client import GenerateClient
from spec_edge.ros2.messages import response_to_dict


def main() -> None:
    job = json.loads(sys.argv[1])
    rclpy.init(args=[])
    client = GenerateClient(node_name=f"spec_edge_bench_{job.get('index', 0)}")
    try:
        client.wait(300.0)
        time.sleep(max(0.0, job["start_at"] - time.time()))
        started = time.monotonic()
        first = []

        def on_feedback(feedback):
            if not first:
                first.append(time.monotonic() - started)
            return False

        result, status = client.stream(on_feedback, timeout=900, **job["request"])
        latency = time.monotonic() - started
        answer = response_to_dict(result)
    finally:
        client.close()
        rclpy.try_shutdown()
    print(json.dumps({"ttft_s": first[0] if first else latency, "latency_s": latency, "status": status,
                      "num_tokens": answer["num_tokens"], "success": answer["success"], "text": answer["text"],
                      "stats": answer["stats"]}, ensure_ascii=False))


if __name__ == "__main__":
    main()
