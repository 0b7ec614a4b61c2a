"""One client process of bench/concurrency.py: waits for the node, sleeps until start_at (time.time()),
then streams its prompts through the action one after another, each sent as soon as the last answer
arrives. seconds = null: each prompt once; else the prompts again and again (cycling) until that many
seconds have passed since start_at, the request in flight finished. Prints one JSON line per answer:
prompt (index), start_s / done_s (from start_at), cpu_s (this process's CPU since start_at), ttft_s
(first feedback), latency_s, num_tokens, success, text, stats.
argv[1]: {"index": j, "start_at": t, "seconds": S | null, "prompts": [[index, text], ...],
"request": {the other request fields}}."""
import itertools
import json
import sys
import time

import rclpy

from spec_edge.ros2.client import GenerateClient
from spec_edge.ros2.messages import response_to_dict


def main() -> None:
    job = json.loads(sys.argv[1])
    rclpy.init(args=[])
    client = GenerateClient(node_name=f"spec_edge_bench_{job['index']}")
    try:
        client.wait(300.0)
        time.sleep(max(0.0, job["start_at"] - time.time()))
        cpu = time.process_time()
        prompts = job["prompts"] if job["seconds"] is None else itertools.cycle(job["prompts"])
        for index, prompt in prompts:
            started = time.time()
            if job["seconds"] is not None and started - job["start_at"] >= job["seconds"]:
                break
            first = []

            def on_feedback(feedback):
                if not first:
                    first.append(time.time() - started)
                return False

            # 120 s: an answer lost between processes (seen once: the client spun for minutes) fails the run
            result, status = client.stream(on_feedback, timeout=120, prompt=prompt, **job["request"])
            done = time.time()
            answer = response_to_dict(result)
            print(json.dumps({"prompt": index, "start_s": started - job["start_at"], "done_s": done - job["start_at"],
                              "ttft_s": first[0] if first else done - started, "latency_s": done - started,
                              "cpu_s": time.process_time() - cpu, "status": status,
                              "num_tokens": answer["num_tokens"], "success": answer["success"],
                              "text": answer["text"], "stats": answer["stats"]}, ensure_ascii=False), flush=True)
    finally:
        client.close()
        rclpy.try_shutdown()


if __name__ == "__main__":
    main()
